#include "formats/dcp/dcp_content.h"

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

// Elements between consecutive indices of each dim of a row-major `shape`.
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

// Appends the runs of `chunk`'s rows (of its slice `layer` of the first axis
// when layer >= 0), each numbered by its element in a row-major tensor of
// `strides`.
void AppendRows(const SourceShard& chunk, int64_t layer, const std::vector<int64_t>& strides, int element,
                std::vector<SourceShard::Run>* runs) {
  std::vector<int64_t> offsets = chunk.placements[0].global.offsets, sizes = chunk.placements[0].global.sizes;
  int64_t skip = 0;  // elements of the chunk before the slice
  if (layer >= 0) {
    if (layer < offsets[0] || layer >= offsets[0] + sizes[0]) return;
    skip = (layer - offsets[0]) * ShapeNumel({sizes.begin() + 1, sizes.end()});
    offsets.erase(offsets.begin());
    sizes.erase(sizes.begin());
  }
  const int64_t row = sizes.empty() ? 1 : sizes.back();
  const int64_t rows = row == 0 ? 0 : ShapeNumel(sizes) / row;
  std::vector<int64_t> at(sizes.size(), 0);  // index of the row's first element in the chunk
  for (int64_t r = 0; r < rows; ++r) {
    int64_t begin = 0;
    for (size_t d = 0; d < at.size(); ++d) begin += (offsets[d] + at[d]) * strides[d];
    for (SourceShard::Run& run : chunk.RunsOf(skip + r * row, row, element)) {
      run.begin += begin;
      runs->push_back(std::move(run));
    }
    for (int d = static_cast<int>(at.size()) - 2; d >= 0; --d) {  // the next row
      if (++at[d] < sizes[d]) break;
      at[d] = 0;
    }
  }
}

}  // namespace

SourceShard SliceRuns(const DcpTensor& t, int64_t layer) {
  const std::vector<int64_t> shape(t.size.begin() + (layer >= 0 ? 1 : 0), t.size.end());
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  const int element = ElementSize(t.dtype);
  std::vector<SourceShard::Run> runs;
  for (const SourceShard& chunk : t.shards) AppendRows(chunk, layer, strides, element, &runs);
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  SourceShard out;
  out.shape = shape;
  for (SourceShard::Run& run : runs) {  // neighbours in the element order and in the file make one run
    SourceShard::Run* last = out.runs.empty() ? nullptr : &out.runs.back();
    if (last != nullptr && last->begin + last->numel == run.begin && last->bytes.data + last->bytes.size == run.bytes.data) {
      last->numel += run.numel;
      last->bytes.size += run.bytes.size;
    } else {
      out.runs.push_back(std::move(run));
    }
  }
  return out;
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
