#include "container/dcp_metadata.h"

#include <algorithm>
#include <utility>

#include "container/mapped_file.h"
#include "pickle/value.h"
#include "util/box.h"

namespace reshard {

const DcpStorage* DcpMetadata::Find(const std::string& fqn,
                                    const std::vector<int64_t>& offsets) const {
  auto it = storage.find(DcpStorageKey{fqn, offsets});
  return it == storage.end() ? nullptr : &it->second;
}

const KnownClasses& DcpKnownClasses() {
  using Kind = KnownClass::Kind;
  static const KnownClasses known = {
      {"torch.distributed.checkpoint.metadata.Metadata", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.metadata.TensorStorageMetadata", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.metadata.BytesStorageMetadata", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.metadata.ChunkStorageMetadata", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.metadata.MetadataIndex", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.metadata.StorageMeta", {Kind::kRecord, {}}},
      // Its __setstate__ takes (dtype, layout, requires_grad, memory_format, pin_memory).
      {"torch.distributed.checkpoint.metadata.TensorProperties", {Kind::kTupleRecord, {}}},
      {"torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
       {Kind::kEnum, {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}}},
      {"torch.distributed.checkpoint.filesystem._StorageInfo", {Kind::kRecord, {}}},
      // Megatron-Core stores its ranks' save plans in the metadata.
      {"torch.distributed.checkpoint.planner.SavePlan", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.planner.WriteItem", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.planner.TensorWriteData", {Kind::kRecord, {}}},
      {"torch.distributed.checkpoint.planner.WriteItemType",
       {Kind::kEnum, {"SHARD", "TENSOR", "BYTE_IO"}}},
      // StorageMeta.checkpoint_id when the save path was a Path (pathlib._local
      // under Python 3.13).
      {"pathlib.PosixPath", {Kind::kValue, {}}},
      {"pathlib._local.PosixPath", {Kind::kValue, {}}},
  };
  return known;
}

namespace {

std::string Dims(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace

bool DcpChunkInside(const std::vector<int64_t>& size, const Box& chunk) {
  bool inside = chunk.offsets.size() == size.size() && chunk.sizes.size() == size.size();
  for (size_t d = 0; inside && d < size.size(); ++d) {
    inside = chunk.offsets[d] >= 0 && chunk.sizes[d] >= 0 && chunk.sizes[d] <= size[d] - chunk.offsets[d];
  }
  return inside;
}

// Overlaps are found by a sweep along the first axis.
std::string DcpTilingProblem(const std::string& fqn, const DcpItem& item) {
  int64_t covered = 0;
  std::vector<Box> boxes = item.chunks;
  for (const Box& c : boxes) covered += c.numel();
  std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return a.offsets < b.offsets; });
  for (size_t i = 0; i < boxes.size(); ++i) {
    for (size_t j = i + 1; j < boxes.size(); ++j) {
      if (boxes[i].rank() > 0 && boxes[j].offsets[0] >= boxes[i].end(0)) break;
      if (Intersect(boxes[i], boxes[j]) && boxes[i].numel() > 0 && boxes[j].numel() > 0) {
        return "tensor '" + fqn + "' has chunks at " + Dims(boxes[i].offsets) + " and " +
               Dims(boxes[j].offsets) + " that overlap";
      }
    }
  }
  const int64_t numel = Box::Whole(item.size).numel();
  if (covered == numel) return "";
  return "tensor '" + fqn + "' of size " + Dims(item.size) + " has chunks holding " +
         std::to_string(covered) + " of its " + std::to_string(numel) + " elements";
}

namespace {

bool IsObjectOf(const Value& v, const char* name) {
  if (!v.is(Value::Kind::kObject)) return false;
  const Global& cls = v.as_object().cls;
  return cls.module.rfind("torch.distributed.checkpoint.", 0) == 0 && cls.name == name;
}

// Turns a Value tree that unpickled without error into DcpMetadata, naming
// `path` in every error.
class MetadataParser {
 public:
  explicit MetadataParser(std::string path) : path_(std::move(path)) {}

  Result<DcpMetadata> Parse(const Value& root) {
    if (!IsObjectOf(root, "Metadata")) {
      return Bad("holds " + root.DebugString(80) + ", not a torch.distributed.checkpoint Metadata");
    }
    const Value* items = Find(root, "state_dict_metadata");
    const Value* storage = Find(root, "storage_data");
    if (items == nullptr || DictItems(*items) == nullptr)
      return Bad("has no state_dict_metadata dict");
    if (storage == nullptr || DictItems(*storage) == nullptr) return Bad("has no storage_data dict");
    for (const auto& [key, item] : *DictItems(*items)) {
      RESHARD_RETURN_IF_ERROR(AddItem(key, item));
    }
    for (const auto& [key, where] : *DictItems(*storage)) {
      RESHARD_RETURN_IF_ERROR(AddStorage(key, where));
    }
    RESHARD_RETURN_IF_ERROR(CheckEveryItemStored());
    RESHARD_RETURN_IF_ERROR(ReadOrigShapes(Find(root, "mcore_data")));
    return std::move(meta_);
  }

 private:
  Status Bad(const std::string& problem) const {
    return Status::InvalidInput(path_ + ": " + problem + "; it is not a readable Distributed "
                                "Checkpoint .metadata file");
  }

  Status AddItem(const Value& key, const Value& item) {
    if (!key.is(Value::Kind::kString)) return Bad("has an item key " + key.DebugString(60));
    const std::string& fqn = key.as_string();
    DcpItem out;
    if (IsObjectOf(item, "BytesStorageMetadata")) {
      out.kind = DcpItem::Kind::kBytes;
    } else if (IsObjectOf(item, "TensorStorageMetadata")) {
      out.kind = DcpItem::Kind::kTensor;
      RESHARD_RETURN_IF_ERROR(ReadTensor(fqn, item, &out));
    } else {
      return Bad("describes item '" + fqn + "' as " + item.DebugString(80));
    }
    if (!meta_.items.emplace(fqn, std::move(out)).second) return Bad("lists item '" + fqn + "' twice");
    meta_.order.push_back(fqn);
    return Status::Ok();
  }

  Status ReadTensor(const std::string& fqn, const Value& item, DcpItem* out) const {
    const Value* properties = Find(item, "properties");
    const Value* size = Find(item, "size");
    const Value* chunks = Find(item, "chunks");
    if (size == nullptr || !ReadIntSequence(*size, &out->size))
      return Bad("tensor '" + fqn + "' has no size");
    if (properties == nullptr) return Bad("tensor '" + fqn + "' has no properties");
    RESHARD_RETURN_IF_ERROR(ReadDType(fqn, *properties, &out->dtype));
    if (chunks == nullptr || !chunks->is(Value::Kind::kList))
      return Bad("tensor '" + fqn + "' has no list of chunks");
    for (const Value& c : chunks->as_list().items) {
      Box chunk;
      const Value* offsets = IsObjectOf(c, "ChunkStorageMetadata") ? Find(c, "offsets") : nullptr;
      const Value* sizes = IsObjectOf(c, "ChunkStorageMetadata") ? Find(c, "sizes") : nullptr;
      if (offsets == nullptr || sizes == nullptr || !ReadIntSequence(*offsets, &chunk.offsets) ||
          !ReadIntSequence(*sizes, &chunk.sizes)) {
        return Bad("tensor '" + fqn + "' has a chunk " + c.DebugString(80));
      }
      RESHARD_RETURN_IF_ERROR(CheckChunk(fqn, out->size, chunk));
      out->chunks.push_back(std::move(chunk));
    }
    return CheckTiled(fqn, *out);
  }

  Status CheckTiled(const std::string& fqn, const DcpItem& item) const {
    const std::string problem = DcpTilingProblem(fqn, item);
    return problem.empty() ? Status::Ok() : Bad(problem);
  }

  // TensorProperties' state is a tuple whose first field is the dtype.
  Status ReadDType(const std::string& fqn, const Value& properties, DType* dtype) const {
    const Value* state = properties.is(Value::Kind::kObject) ? properties.as_object().state.get()
                                                              : nullptr;
    if (!IsObjectOf(properties, "TensorProperties") || state == nullptr ||
        !state->is(Value::Kind::kTuple) || state->as_tuple().items.empty()) {
      return Bad("tensor '" + fqn + "' has properties " + properties.DebugString(80));
    }
    const Value& name = state->as_tuple().items[0];
    if (name.is(Value::Kind::kGlobal) && name.as_global().module == "torch") {
      for (int d = 0; d <= static_cast<int>(DType::kComplex128); ++d) {  // the last DType
        if (name.as_global().name == DTypeName(static_cast<DType>(d))) {
          *dtype = static_cast<DType>(d);
          return Status::Ok();
        }
      }
    }
    return Bad("tensor '" + fqn + "' has the dtype " + name.DebugString(60) +
               ", which reshard does not know");
  }

  Status CheckChunk(const std::string& fqn, const std::vector<int64_t>& size,
                    const Box& chunk) const {
    if (DcpChunkInside(size, chunk)) return Status::Ok();
    return Bad("tensor '" + fqn + "' of size " + Dims(size) + " has a chunk at " +
               Dims(chunk.offsets) + " of size " + Dims(chunk.sizes) + " outside it");
  }

  Status AddStorage(const Value& key, const Value& where) {
    const Value* fqn = IsObjectOf(key, "MetadataIndex") ? Find(key, "fqn") : nullptr;
    if (fqn == nullptr || !fqn->is(Value::Kind::kString))
      return Bad("has a storage entry keyed " + key.DebugString(80));
    DcpStorageKey k{fqn->as_string(), {}};
    const Value* offsets = Find(key, "offset");
    if (offsets != nullptr && !offsets->is_none() && !ReadIntSequence(*offsets, &k.offsets))
      return Bad("has a storage entry of '" + k.fqn + "' at " + offsets->DebugString(60));
    DcpStorage s;
    RESHARD_RETURN_IF_ERROR(ReadStorageInfo(k.fqn, where, &s));
    if (!meta_.storage.emplace(k, std::move(s)).second)
      return Bad("has two storage entries of '" + k.fqn + "' at " + Dims(k.offsets));
    return Status::Ok();
  }

  Status ReadStorageInfo(const std::string& fqn, const Value& where, DcpStorage* out) const {
    const Value* path = Find(where, "relative_path");
    const Value* offset = Find(where, "offset");
    const Value* length = Find(where, "length");
    const bool fits = IsObjectOf(where, "_StorageInfo") && path != nullptr &&
                      path->is(Value::Kind::kString) && offset != nullptr &&
                      offset->is(Value::Kind::kInt) && offset->as_int() >= 0 &&
                      length != nullptr && length->is(Value::Kind::kInt) && length->as_int() >= 0;
    if (!fits) return Bad("stores '" + fqn + "' at " + where.DebugString(100));
    // torch >= 2.8 may compress or otherwise transform an item's stream.
    const Value* transforms = Find(where, "transform_descriptors");
    if (transforms != nullptr && !transforms->is_none() &&
        !(transforms->is(Value::Kind::kList) && transforms->as_list().items.empty()) &&
        !(transforms->is(Value::Kind::kTuple) && transforms->as_tuple().items.empty())) {
      return Status::Unsupported(path_ + ": item '" + fqn + "' is stored through the transforms " +
                                 transforms->DebugString(80) + ", which reshard cannot read");
    }
    // The index names files of the checkpoint's own folder; a path that
    // leads elsewhere is not one torch writes, and must not be followed.
    const std::string& name = path->as_string();
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      return Bad("stores '" + fqn + "' in '" + name + "', which is not a file name of the folder");
    *out = DcpStorage{name, static_cast<uint64_t>(offset->as_int()),
                      static_cast<uint64_t>(length->as_int())};
    return Status::Ok();
  }

  // Megatron-Core's {fqn: {'nd_reformulated_orig_global_shape': shape}};
  // the entries of tensors it saved as they are are empty dicts.
  Status ReadOrigShapes(const Value* mcore_data) {
    if (mcore_data == nullptr || mcore_data->is_none()) return Status::Ok();
    if (DictItems(*mcore_data) == nullptr) return Bad("has mcore_data " + mcore_data->DebugString(60));
    for (const auto& [key, entry] : *DictItems(*mcore_data)) {
      const Value* shape = Find(entry, "nd_reformulated_orig_global_shape");
      if (shape == nullptr) continue;
      std::vector<int64_t> dims;
      if (!key.is(Value::Kind::kString) || !ReadIntSequence(*shape, &dims)) {
        return Bad("has an mcore_data entry " + key.DebugString(60) + " with the original shape " +
                   shape->DebugString(60));
      }
      meta_.nd_reformulated_orig_shapes[key.as_string()] = std::move(dims);
    }
    return Status::Ok();
  }

  Status CheckEveryItemStored() const {
    for (const auto& [fqn, item] : meta_.items) {
      if (item.kind == DcpItem::Kind::kBytes && meta_.Find(fqn, {}) == nullptr)
        return Bad("has no storage entry for the bytes item '" + fqn + "'");
      for (const Box& chunk : item.chunks) {
        if (meta_.Find(fqn, chunk.offsets) == nullptr)
          return Bad("has no storage entry for the chunk of '" + fqn + "' at " + Dims(chunk.offsets));
      }
    }
    return Status::Ok();
  }

  std::string path_;
  DcpMetadata meta_;
};

}  // namespace

const std::set<std::string>& MegatronPackages() {
  static const std::set<std::string> packages = {"megatron"};
  return packages;
}

Result<DcpMetadata> ReadDcpMetadata(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  const std::string not_readable = "; it is not a readable Distributed Checkpoint .metadata file (restore it from "
                                   "the saved checkpoint)";
  if (file->size() == 0) return Status::InvalidInput(path + " is empty" + not_readable);
  PickleReadOptions options;
  options.known_classes = &DcpKnownClasses();
  // Only plain data is taken from the tree, so Megatron-Core's classes
  // (MCoreSavePlan) may stay opaque.
  options.inert_packages = MegatronPackages();
  PickleReader reader(options, StorageResolver());
  Result<Value> root = reader.Parse(file->data(), file->size());
  if (!root.ok() && root.status().code() == Status::Code::kInvalidInput) {
    return Status::InvalidInput(path + " (" + std::to_string(file->size()) + " bytes): " + root.status().message() +
                                not_readable);
  }
  if (!root.ok()) return root.status().WithContext(path);
  return MetadataParser(path).Parse(*root);
}

}  // namespace reshard
