#include "formats/dcp_common/dcp_content.h"

#include <algorithm>
#include <regex>

#include "container/dcp_item.h"
#include "container/json_reader.h"
#include "container/regular_file.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

class ContentReader {
 public:
  explicit ContentReader(DcpContent* content) : c_(*content) {}

  Status ReadAll() {
    for (const auto& [fqn, item] : c_.meta.items) {
      if (item.kind == DcpItem::Kind::kBytes) {
        // Mapped now, so that the file is the checkpoint's like the others.
        RESHARD_RETURN_IF_ERROR(File(c_.meta.Find(fqn, {})->relative_path).status());
        c_.bytes_items.push_back(fqn);
        continue;
      }
      DcpTensor t{fqn, item.dtype, item.size, {}};
      for (const DcpChunk& chunk : item.chunks) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, ReadChunk(fqn, chunk));
        t.shards.push_back(std::move(shard));
      }
      c_.tensors.push_back(std::move(t));
    }
    return Status::Ok();
  }

 private:
  Result<SourceShard> ReadChunk(const std::string& fqn, const DcpChunk& chunk) {
    const DcpStorage& where = *c_.meta.Find(fqn, chunk.offsets);  // ReadDcpMetadata checked it is there
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, File(where.relative_path));
    RESHARD_ASSIGN_OR_RETURN(Value tensor, ReadDcpChunk(file, c_.meta, fqn, chunk));
    SourceShard shard = SourceShard::Of(tensor.as_tensor(), ShardCoords{});
    shard.placements = {Placement{Box{chunk.offsets, chunk.sizes}, std::vector<int64_t>(chunk.sizes.size(), 0)}};
    return shard;
  }

  Result<std::shared_ptr<const MappedFile>> File(const std::string& name) {
    auto it = c_.files.find(name);
    if (it != c_.files.end()) return it->second;
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(c_.folder + "/" + name));
    c_.files.emplace(name, file);
    return file;
  }

  DcpContent& c_;
};

}  // namespace

SourceShard SliceRuns(const DcpTensor& t, int64_t layer) {
  return JoinRuns(t.shards, t.size, ElementSize(t.dtype), layer);
}

const DcpTensor* DcpContent::FindTensor(const std::string& fqn) const {
  for (const DcpTensor& t : tensors) {
    if (t.fqn == fqn) return &t;
  }
  return nullptr;
}

Result<Value> DcpContent::ReadBytes(const std::string& fqn) const {
  const DcpStorage* where = meta.Find(fqn, {});
  if (where == nullptr) return Status::InvalidInput(folder + "/" + kDcpMetadataFile + " lists no bytes item " + fqn);
  return ReadDcpItem(files.at(where->relative_path), *where);  // every item's file was mapped
}

std::vector<std::string> DcpContent::Paths() const {
  std::vector<std::string> paths{folder + "/" + kDcpMetadataFile};
  for (const auto& [name, file] : files) paths.push_back(folder + "/" + name);
  return paths;
}

bool IsTorchDistFolder(const std::string& folder) {
  Result<std::string> text = ReadRegularFile(folder + "/metadata.json", 1 << 16);
  if (!text.ok()) return false;
  Result<Value> json = ParseJson(*text, folder + "/metadata.json");
  const Value* backend = json.ok() ? Find(*json, "sharded_backend") : nullptr;
  return backend != nullptr && backend->is(Value::Kind::kString) && backend->as_string() == "torch_dist";
}

int64_t IterationOfFolder(const std::string& folder) {
  static const std::regex iter(".*iter_([0-9]+)/?$");
  std::smatch m;
  int64_t iteration = 0;
  return std::regex_match(folder, m, iter) && ParseInt(m[1].str(), &iteration) ? iteration : 0;
}

Result<DcpContent> ReadDcpContent(const std::string& folder) {
  DcpContent content;
  content.folder = folder;
  RESHARD_ASSIGN_OR_RETURN(content.meta, ReadDcpMetadata(folder + "/" + kDcpMetadataFile));
  RESHARD_RETURN_IF_ERROR(ContentReader(&content).ReadAll());
  return content;
}

}  // namespace reshard
