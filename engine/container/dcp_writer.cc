#include "container/dcp_writer.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <utility>

#include "container/kernel_copy.h"
#include "container/write_fully.h"
#include "pickle/pickle_writer.h"
#include "util/shape.h"

namespace reshard {
namespace {

// What torch 2.6's torch.save writes beside the pickle.
constexpr char kByteOrder[] = "little";
constexpr char kVersion[] = "3\n";

int64_t ChunkBytes(const DcpWriteItem& item) {
  return item.kind == DcpItem::Kind::kTensor ? ShapeNumel(item.chunk.sizes) * ElementSize(item.dtype) : 0;
}

// torch writes a 40-digit id per archive; reshard's is the item's place, so
// that its files are the same every time.
std::string SerializationId(uint64_t offset, size_t index) {
  char id[48];
  std::snprintf(id, sizeof(id), "%020llu%020llu", static_cast<unsigned long long>(offset),
                static_cast<unsigned long long>(index));
  return id;
}

// One record of an item's archive: bytes given, or a tensor's produced.
struct Record {
  std::string name;
  std::string bytes;
  const DcpWriteItem* tensor = nullptr;  // the record is its chunk's bytes
};

// torch.save's record order.
std::vector<Record> Records(const DcpWriteItem& item, const DcpItemPlace& place, size_t index) {
  std::vector<Record> records;
  records.push_back({"archive/data.pkl", place.pickle});
  records.push_back({"archive/byteorder", kByteOrder});
  if (item.kind == DcpItem::Kind::kTensor) records.push_back({"archive/data/0", "", &item});
  records.push_back({"archive/version", kVersion});
  records.push_back({"archive/.data/serialization_id", SerializationId(place.offset, index)});
  return records;
}

// Where the items' bytes go: into a file from an offset on, or nowhere when
// they are only counted (to place them). Small pieces gather until a
// tensor's bytes or the end.
class ItemOutput {
 public:
  ItemOutput() = default;  // counts only
  ItemOutput(int fd, const std::string& path, uint64_t offset, std::vector<uint8_t>* buffer,
             const std::function<void(int64_t)>* written)
      : fd_(fd), path_(&path), buffer_(buffer), written_(written) {
    digest_.offset = static_cast<int64_t>(offset);
  }

  // Bytes put so far.
  uint64_t at() const { return at_; }

  Status Put(const std::string& bytes) {
    at_ += bytes.size();
    if (fd_ >= 0) pending_ += bytes;
    return Status::Ok();
  }

  // The chunk's bytes of `item`, whole elements at a time (producers that
  // convert values see whole ones); returns their CRC-32.
  Result<uint32_t> Stream(const DcpWriteItem& item) {
    const int64_t size = ChunkBytes(item);
    at_ += static_cast<uint64_t>(size);
    if (fd_ < 0) return 0u;
    RESHARD_RETURN_IF_ERROR(Flush());
    const int es = ElementSize(item.dtype);
    const int64_t step = std::max<int64_t>(es, static_cast<int64_t>(buffer_->size()) / es * es);
    if (buffer_->size() < static_cast<size_t>(step)) buffer_->resize(static_cast<size_t>(step));
    uint32_t crc = 0;
    FileSpans spans;
    for (int64_t done = 0; done < size;) {
      const int64_t n = std::min(step, size - done);
      spans.clear();
      Status st = item.produce(done, n, buffer_->data(), SpanSink(&spans, buffer_->data(), n));
      if (!st.ok()) return st.WithContext(*path_ + ": item '" + item.fqn + "'");
      const uint32_t piece = ProducedCrc(0, buffer_->data(), static_cast<size_t>(n), spans);
      crc = Crc32Combine(crc, piece, n);
      RESHARD_RETURN_IF_ERROR(Write(buffer_->data(), n, piece, spans));
      if (*written_) (*written_)(n);
      done += n;
    }
    return crc;
  }

  Status Flush() {
    const std::string pending = std::move(pending_);
    pending_.clear();
    const auto* bytes = reinterpret_cast<const uint8_t*>(pending.data());
    return Write(bytes, static_cast<int64_t>(pending.size()), Crc32(0, bytes, pending.size()), {});
  }

  const FileDigest& digest() const { return digest_; }

 private:
  // `crc` is that of the n bytes, which `spans` may say are a file's.
  Status Write(const uint8_t* data, int64_t n, uint32_t crc, const FileSpans& spans) {
    if (int err = WriteProduced(fd_, data, static_cast<size_t>(n), digest_.offset + digest_.bytes, spans)) {
      return Status::IoError("cannot write " + *path_ + ": " + std::strerror(err));
    }
    digest_.crc32 = Crc32Combine(digest_.crc32, crc, n);
    digest_.bytes += n;
    return Status::Ok();
  }

  int fd_ = -1;
  const std::string* path_ = nullptr;
  std::vector<uint8_t>* buffer_ = nullptr;
  const std::function<void(int64_t)>* written_ = nullptr;
  uint64_t at_ = 0;
  std::string pending_;
  FileDigest digest_;
};

// Puts one item's archive: each record's local header, data and data
// descriptor, then the central directory and the end records.
Status PutItem(const std::vector<Record>& records, const ZipStyle& style, ItemOutput* out) {
  const uint64_t start = out->at();
  std::vector<ZipEntry> entries;
  for (const Record& r : records) {
    ZipEntry entry{r.name, out->at() - start,
                   r.tensor ? static_cast<uint64_t>(ChunkBytes(*r.tensor)) : r.bytes.size(), 0};
    RESHARD_RETURN_IF_ERROR(out->Put(ZipLocalHeader(entry, style)));
    if (r.tensor) {
      RESHARD_ASSIGN_OR_RETURN(entry.crc, out->Stream(*r.tensor));
    } else {
      entry.crc = Crc32(0, reinterpret_cast<const uint8_t*>(r.bytes.data()), r.bytes.size());
      RESHARD_RETURN_IF_ERROR(out->Put(r.bytes));
    }
    RESHARD_RETURN_IF_ERROR(out->Put(ZipDataDescriptor(entry, style)));
    entries.push_back(std::move(entry));
  }
  const uint64_t directory = out->at() - start;
  for (const ZipEntry& entry : entries) RESHARD_RETURN_IF_ERROR(out->Put(ZipCentralHeader(entry, style)));
  return out->Put(ZipEndRecords(entries.size(), directory, out->at() - start - directory, style));
}

Status CheckItem(const std::string& file, const DcpWriteItem& item) {
  const auto bad = [&](const std::string& what) {
    return Status::InvalidInput(file + ": item '" + item.fqn + "' " + what);
  };
  if (item.fqn.empty()) return Status::InvalidInput(file + ": an item has no key");
  if (item.kind == DcpItem::Kind::kBytes) return Status::Ok();
  if (!DcpChunkInside(item.size, item.chunk)) return bad("has a chunk outside its tensor");
  if (!item.produce) return bad("has no producer of its bytes");
  return Status::Ok();
}

// data.pkl: the chunk as a tensor over a storage of its own, or the object.
Result<std::string> ItemPickle(const DcpWriteItem& item) {
  if (item.kind == DcpItem::Kind::kTensor) {
    return WritePickle(MakeProducedTensor(item.dtype, item.chunk.sizes, item.produce), {});
  }
  return WritePickle(item.object, [&item](const std::string&, const Storage&) {
    return Status::InvalidInput("the bytes item '" + item.fqn + "' holds a tensor");
  });
}

}  // namespace

DcpWriteItem DcpTensorItem(std::string fqn, DType dtype, std::vector<int64_t> size, Box chunk,
                           ByteProducer produce) {
  DcpWriteItem item;
  item.fqn = std::move(fqn);
  item.dtype = dtype;
  item.size = std::move(size);
  item.chunk = std::move(chunk);
  item.produce = std::move(produce);
  return item;
}

DcpWriteItem DcpBytesItem(std::string fqn, Value object) {
  DcpWriteItem item;
  item.fqn = std::move(fqn);
  item.kind = DcpItem::Kind::kBytes;
  item.object = std::move(object);
  return item;
}

Result<DcpFileLayout> LayOutDcpFile(std::string name, std::vector<DcpWriteItem> items,
                                    const DcpWriteOptions& options) {
  // The reader refuses any other relative_path, which could leave the folder.
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return Status::InvalidInput("'" + name + "' is not a file name for a .distcp file");
  }
  DcpFileLayout layout;
  layout.name = std::move(name);
  layout.style = ZipStyle{options.zip64_threshold, /*data_descriptors=*/true};
  for (size_t i = 0; i < items.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(CheckItem(layout.name, items[i]));
    DcpItemPlace place;
    place.offset = layout.size;
    RESHARD_ASSIGN_OR_RETURN(place.pickle, ItemPickle(items[i]));
    ItemOutput counter;
    RESHARD_RETURN_IF_ERROR(PutItem(Records(items[i], place, i), layout.style, &counter));
    place.length = counter.at();
    layout.size += place.length;
    layout.places.push_back(std::move(place));
  }
  layout.items = std::move(items);
  return layout;
}

int64_t DcpTensorBytes(const DcpFileLayout& layout, size_t first, size_t last) {
  int64_t bytes = 0;
  for (size_t i = first; i < last; ++i) bytes += ChunkBytes(layout.items[i]);
  return bytes;
}

std::vector<size_t> DcpCuts(const DcpFileLayout& layout, int64_t part_bytes) {
  std::vector<size_t> cuts = {0};
  uint64_t run = 0;
  for (size_t i = 0; i < layout.places.size(); ++i) {
    run += layout.places[i].length;
    if (run >= static_cast<uint64_t>(part_bytes) && i + 1 < layout.places.size()) {
      cuts.push_back(i + 1);
      run = 0;
    }
  }
  cuts.push_back(layout.items.size());
  return cuts;
}

Result<FileDigest> WriteDcpItems(const std::string& path, const DcpFileLayout& layout, size_t first,
                                 size_t last, std::vector<uint8_t>* buffer,
                                 const std::function<void(int64_t)>& written) {
  if (first > last || last > layout.items.size()) {
    return Status::Internal(path + ": no items " + std::to_string(first) + " to " + std::to_string(last));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return Status::IoError("cannot write " + path + ": " + std::strerror(errno));
  FileCloser closer(fd);
  const uint64_t offset = first < last ? layout.places[first].offset : layout.size;
  if (buffer->empty()) buffer->resize(1 << 20);
  ItemOutput out(fd, path, offset, buffer, &written);
  for (size_t i = first; i < last; ++i) {
    const DcpItemPlace& place = layout.places[i];
    RESHARD_RETURN_IF_ERROR(PutItem(Records(layout.items[i], place, i), layout.style, &out));
    if (out.at() != place.offset + place.length - offset) {
      return Status::Internal(path + ": item '" + layout.items[i].fqn + "' did not fill its planned bytes");
    }
  }
  RESHARD_RETURN_IF_ERROR(out.Flush());
  return out.digest();
}

namespace {

const char kMetadataModule[] = "torch.distributed.checkpoint.metadata";

// cls() then BUILD with `state` (none: no BUILD), as torch's pickler writes
// a dataclass.
Value Built(const char* module, const char* name, Value state) {
  Object o;
  o.cls = Global{module, name};
  o.construct = Object::Construct::kNewObj;
  if (!state.is_none()) o.state = std::make_shared<Value>(std::move(state));
  return Value::MakeObject(std::move(o));
}

// A call `module.name(args...)`.
Value Called(const char* module, const char* name, std::vector<Value> args) {
  Object o;
  o.cls = Global{module, name};
  o.args = std::move(args);
  return Value::MakeObject(std::move(o));
}

Value StringDict(std::vector<std::pair<const char*, Value>> fields) {
  Items items;
  for (auto& [key, value] : fields) items.emplace_back(Value::String(key), std::move(value));
  return Value::MakeDict(std::move(items));
}

// TensorProperties' __setstate__ takes (dtype, layout, requires_grad,
// memory_format, pin_memory); a saved tensor is strided and contiguous.
Value TensorProperties(DType dtype) {
  return Built(kMetadataModule, "TensorProperties",
               Value::MakeTuple({Value::MakeGlobal(Global{"torch", DTypeName(dtype)}),
                                 Called("torch.serialization", "_get_layout", {Value::String("torch.strided")}),
                                 Value::Bool(false),
                                 Called(kMetadataModule, "_MEM_FORMAT_ENCODING", {Value::Int(0)}),
                                 Value::Bool(false)}));
}

Value TensorStorageMetadata(const DcpItem& item) {
  std::vector<Value> chunks;
  for (const Box& c : item.chunks) {
    chunks.push_back(Built(kMetadataModule, "ChunkStorageMetadata",
                           StringDict({{"offsets", MakeTorchSize(c.offsets)}, {"sizes", MakeTorchSize(c.sizes)}})));
  }
  return Built(kMetadataModule, "TensorStorageMetadata",
               StringDict({{"properties", TensorProperties(item.dtype)},
                           {"size", MakeTorchSize(item.size)},
                           {"chunks", Value::MakeList(std::move(chunks))}}));
}

// MetadataIndex(fqn, offset, index): a bytes item has neither offset nor
// index; a chunk's index is its place in its tensor's chunk list.
Value MetadataIndex(const std::string& fqn, const std::vector<int64_t>* offsets, size_t index) {
  if (offsets == nullptr) {
    return Built(kMetadataModule, "MetadataIndex", StringDict({{"fqn", Value::String(fqn)}, {"index", Value()}}));
  }
  return Built(kMetadataModule, "MetadataIndex",
               StringDict({{"fqn", Value::String(fqn)},
                           {"index", Value::Int(static_cast<int64_t>(index))},
                           {"offset", MakeTorchSize(*offsets)}}));
}

Value StorageInfo(const DcpStorage& s) {
  return Built("torch.distributed.checkpoint.filesystem", "_StorageInfo",
               StringDict({{"relative_path", Value::String(s.relative_path)},
                           {"offset", Value::Int(static_cast<int64_t>(s.offset))},
                           {"length", Value::Int(static_cast<int64_t>(s.length))}}));
}

Value PathTuple(const std::vector<Value>& path) { return Value::MakeTuple(path); }

// What the files hold as the reader's plain data, checked as the reader
// checks it, with each key's planner path.
class Gathered {
 public:
  Status Add(const DcpFileLayout& file) {
    for (size_t i = 0; i < file.items.size(); ++i) {
      const DcpWriteItem& w = file.items[i];
      const DcpStorage where{file.name, file.places[i].offset, file.places[i].length};
      auto [it, first] = meta_.items.emplace(w.fqn, DcpItem{w.kind, w.dtype, w.size, {}});
      const DcpItem& item = it->second;
      const auto orig = reformulated_from_.emplace(w.fqn, w.reformulated_from).first;
      if (!first && (item.kind != w.kind || item.kind == DcpItem::Kind::kBytes || item.dtype != w.dtype ||
                     item.size != w.size || orig->second != w.reformulated_from)) {
        return Status::InvalidInput(file.name + ": item '" + w.fqn + "' is written again, unlike before");
      }
      if (w.kind == DcpItem::Kind::kTensor) it->second.chunks.push_back(w.chunk);
      const std::vector<int64_t> offsets = w.kind == DcpItem::Kind::kTensor ? w.chunk.offsets : std::vector<int64_t>{};
      if (!meta_.storage.emplace(DcpStorageKey{w.fqn, offsets}, where).second) {
        return Status::InvalidInput(file.name + ": two chunks of '" + w.fqn + "' start at one place");
      }
      paths_.emplace(w.fqn, w.path.empty() ? std::vector<Value>{Value::String(w.fqn)} : w.path);
    }
    return Status::Ok();
  }

  Status CheckTiled() const {
    for (const auto& [fqn, item] : meta_.items) {
      if (item.kind != DcpItem::Kind::kTensor) continue;
      const std::string problem = DcpTilingProblem(fqn, item);
      if (!problem.empty()) return Status::InvalidInput("Distributed Checkpoint metadata: " + problem);
    }
    return Status::Ok();
  }

  // Megatron-Core 0.14's {fqn: {} or {'nd_reformulated_orig_global_shape': dims}}.
  Value McoreData() const {
    Items entries;
    for (const auto& [fqn, item] : meta_.items) {
      if (item.kind != DcpItem::Kind::kTensor) continue;
      const std::vector<int64_t>& orig = reformulated_from_.at(fqn);
      Items entry;
      if (!orig.empty()) {
        std::vector<Value> dims;
        for (int64_t d : orig) dims.push_back(Value::Int(d));
        entry.emplace_back(Value::String("nd_reformulated_orig_global_shape"), Value::MakeTuple(std::move(dims)));
      }
      entries.emplace_back(Value::String(fqn), Value::MakeDict(std::move(entry)));
    }
    return Value::MakeDict(std::move(entries));
  }

  // Metadata(state_dict_metadata, planner_data, storage_data, storage_meta
  // [, mcore_data]).
  Value Root(const DcpMetadataOptions& options) const {
    Items items, planner, storage;
    for (const auto& [fqn, item] : meta_.items) {
      planner.emplace_back(Value::String(fqn), PathTuple(paths_.at(fqn)));
      if (item.kind == DcpItem::Kind::kBytes) {
        items.emplace_back(Value::String(fqn), Built(kMetadataModule, "BytesStorageMetadata", Value()));
        storage.emplace_back(MetadataIndex(fqn, nullptr, 0), StorageInfo(*meta_.Find(fqn, {})));
        continue;
      }
      items.emplace_back(Value::String(fqn), TensorStorageMetadata(item));
      for (size_t i = 0; i < item.chunks.size(); ++i) {
        const std::vector<int64_t>& offsets = item.chunks[i].offsets;
        storage.emplace_back(MetadataIndex(fqn, &offsets, i), StorageInfo(*meta_.Find(fqn, offsets)));
      }
    }
    // checkpoint_id is informational (readers must not follow it), and the
    // ids are torch's per run: none here, so the file is deterministic.
    Value storage_meta = Built(kMetadataModule, "StorageMeta",
                               StringDict({{"checkpoint_id", Value()}, {"save_id", Value()}, {"load_id", Value()}}));
    std::vector<std::pair<const char*, Value>> fields = {{"state_dict_metadata", Value::MakeDict(std::move(items))},
                                                         {"planner_data", Value::MakeDict(std::move(planner))},
                                                         {"storage_data", Value::MakeDict(std::move(storage))},
                                                         {"storage_meta", std::move(storage_meta)}};
    if (options.mcore_data) fields.emplace_back("mcore_data", McoreData());
    return Built(kMetadataModule, "Metadata", StringDict(std::move(fields)));
  }

 private:
  DcpMetadata meta_;
  std::map<std::string, std::vector<int64_t>> reformulated_from_;
  std::map<std::string, std::vector<Value>> paths_;
};

}  // namespace

Result<std::string> DcpMetadataPickle(const std::vector<const DcpFileLayout*>& files,
                                      const DcpMetadataOptions& options) {
  Gathered gathered;
  for (const DcpFileLayout* file : files) RESHARD_RETURN_IF_ERROR(gathered.Add(*file));
  RESHARD_RETURN_IF_ERROR(gathered.CheckTiled());
  return WritePickle(gathered.Root(options), {});
}

}  // namespace reshard
