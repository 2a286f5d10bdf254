#include "formats/dcp_common/dcp_content.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>

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
      for (const Box& chunk : item.chunks) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, ReadChunk(fqn, chunk));
        t.shards.push_back(std::move(shard));
      }
      c_.tensors.push_back(std::move(t));
    }
    return Status::Ok();
  }

 private:
  Result<SourceShard> ReadChunk(const std::string& fqn, const Box& chunk) {
    const DcpStorage& where = *c_.meta.Find(fqn, chunk.offsets);  // ReadDcpMetadata checked it is there
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, File(where.relative_path));
    RESHARD_ASSIGN_OR_RETURN(Value tensor, ReadDcpChunk(file, c_.meta, fqn, chunk));
    SourceShard shard = SourceShard::Of(tensor.as_tensor(), ShardCoords{});
    shard.placements = {Placement{chunk, std::vector<int64_t>(chunk.sizes.size(), 0)}};
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

SourceShard SliceRuns(const DcpTensor& t, const std::vector<int64_t>& lead) {
  return JoinRuns(t.shards, t.size, ElementSize(t.dtype), lead);
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

namespace {

// What Megatron-Core's torch_dist save writes in metadata.json.
constexpr char kMarkerFile[] = "metadata.json";
constexpr char kTorchDistBackend[] = "torch_dist";
constexpr int64_t kTorchDistVersion = 1;
constexpr char kCommonBackend[] = "torch";

// Empty when `json`'s `key` is absent (unless `required`) or holds `want`;
// else what it holds instead.
std::string Mismatch(const Value& json, const char* key, const Value& want, bool required) {
  const Value* v = Find(json, key);
  if (v == nullptr) return required ? std::string("has no ") + key : "";
  if (v->kind() == want.kind() && v->DebugString(80) == want.DebugString(80)) return "";
  return std::string("has ") + key + " " + v->DebugString(60) + " where Megatron-Core writes " + want.DebugString(60);
}

}  // namespace

Result<bool> ReadTorchDistMarker(const std::string& folder) {
  const std::string path = folder + "/" + kMarkerFile;
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return false;  // a plain DCP folder
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, 1 << 16));
  RESHARD_ASSIGN_OR_RETURN(Value json, ParseJson(text, path));
  const std::string fix = "; it is not the metadata.json Megatron-Core's torch_dist save writes, so the folder's "
                          "model cannot be told (restore the file from the saved checkpoint)";
  if (DictItems(json) == nullptr) return Status::InvalidInput(path + " holds " + json.DebugString(60) + ", not a JSON object" + fix);
  for (const std::string& problem :
       {Mismatch(json, "sharded_backend", Value::String(kTorchDistBackend), true),
        Mismatch(json, "sharded_backend_version", Value::Int(kTorchDistVersion), true),
        Mismatch(json, "common_backend", Value::String(kCommonBackend), false),
        Mismatch(json, "common_backend_version", Value::Int(kTorchDistVersion), false)}) {
    if (!problem.empty()) return Status::InvalidInput(path + " " + problem + fix);
  }
  return true;
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
  RESHARD_ASSIGN_OR_RETURN(content.torch_dist, ReadTorchDistMarker(folder));
  RESHARD_RETURN_IF_ERROR(ContentReader(&content).ReadAll());
  return content;
}

int64_t RankOfDataFile(const std::string& name) {
  static const std::regex kDataFile("__([0-9]+)_[0-9]+\\.distcp");
  std::smatch m;
  int64_t rank = -1;
  if (!std::regex_match(name, m, kDataFile) || !ParseInt(m[1].str(), &rank)) return -1;
  return rank;
}

int WritingRanks(const std::string& folder) {
  std::set<int64_t> ranks;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == ".distcp" || !EndsWith(name, ".distcp")) continue;
    const int64_t rank = RankOfDataFile(name);
    if (rank < 0) return 0;
    ranks.insert(rank);
  }
  if (ec || ranks.empty() || *ranks.rbegin() + 1 != static_cast<int64_t>(ranks.size())) return 0;
  return static_cast<int>(ranks.size());
}

}  // namespace reshard
