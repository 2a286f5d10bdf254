#include "container/torch_file.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "container/mapped_file.h"
#include "container/record_crc.h"
#include "container/zip_directory.h"
#include "container/zip_writer.h"
#include "pickle/pickle_writer.h"

namespace reshard {
namespace {

constexpr char kZipMagic[] = "PK\x03\x04";

Status CheckZipMagic(const MappedFile& file, const FileWindow& window) {
  const uint8_t* start = file.data() + window.offset;
  FetchExactly(start, std::min<size_t>(4, window.size));  // not the first read_ahead_kb of the file
  if (window.size < 4 || std::memcmp(start, kZipMagic, 4) != 0) {
    return Status::InvalidInput(file.Name(window) +
                                " is not a torch.save zip file (empty, truncated, or the legacy "
                                "pre-1.6 format); re-save it with torch.save");
  }
  return Status::Ok();
}

// Binds storages to their records inside the mapped file. A record holds
// exactly its storage's bytes (torch.save writes no more), so a numel the
// pickle declares that the record does not hold is refused here, before any
// later stage indexes the bytes with it.
StorageResolver MakeResolver(std::shared_ptr<const ZipDirectory> zip,
                             std::shared_ptr<const MappedFile> file) {
  return [zip, file](const std::string& key, DType dtype, int64_t numel,
                     const std::string& location) -> Result<std::shared_ptr<Storage>> {
    const std::string record = "data/" + key;
    const ZipRecord* found = zip->Find(record);
    if (found == nullptr) {
      return Status::InvalidInput("storage record '" + record +
                                  "' is missing; the file is truncated or damaged");
    }
    uint64_t nbytes = 0;
    if (numel < 0 || __builtin_mul_overflow(static_cast<uint64_t>(numel),
                                            static_cast<uint64_t>(ElementSize(dtype)), &nbytes) ||
        nbytes != found->size) {
      return Status::InvalidInput("storage '" + record + "' declares " +
                                  std::to_string(numel) + " " + DTypeName(dtype) +
                                  " elements, but its record holds " + std::to_string(found->size) +
                                  " bytes; the file is damaged");
    }
    auto storage = std::make_shared<Storage>();
    storage->dtype = dtype;
    storage->numel = numel;
    storage->location = location;
    storage->record_key = key;
    storage->bytes = ByteView{file, file->data() + found->data_offset, static_cast<size_t>(nbytes),
                              /*mapped=*/true};
    return storage;
  };
}

// Has the CRC-32 of every storage record checked as the run copies it out
// (the pickle's is checked on its own, above). The archives of one file (a
// `.distcp` file's items) share its checks; their records are named with
// the archive's window, as every item's archive has the same record names.
void WatchStorageRecords(const ZipDirectory& zip, const MappedFile& file, const FileWindow& window) {
  const std::string in_window =
      window.offset == 0 && window.size == file.size()
          ? ""
          : " of the item at bytes " + std::to_string(window.offset) + "-" + std::to_string(window.offset + window.size);
  std::vector<std::pair<std::string, ZipRecord>> storages;
  for (const auto& [name, record] : zip.records()) {
    if (name.find("/data/") != std::string::npos) storages.emplace_back(name + in_window, record);
  }
  if (storages.empty()) return;
  if (file.record_crcs() != nullptr) {
    file.record_crcs()->Add(std::move(storages));
    return;
  }
  auto crcs = std::make_shared<RecordCrcs>(file.path(), std::move(storages));
  RegisterRecordCrcs(crcs);
  file.CheckRecords(std::move(crcs));
}

}  // namespace

Result<Value> ReadTorchFile(const std::string& path, const PickleReadOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  const FileWindow whole = file->whole();
  return ReadTorchArchive(std::move(file), whole, options);
}

Result<Value> ReadTorchArchive(std::shared_ptr<const MappedFile> file, const FileWindow& window,
                               const PickleReadOptions& options) {
  const std::string name = file->Name(window);
  RESHARD_RETURN_IF_ERROR(file->CheckWindow(window));
  RESHARD_RETURN_IF_ERROR(CheckZipMagic(*file, window));
  RESHARD_ASSIGN_OR_RETURN(ZipDirectory directory, ZipDirectory::Read(*file, window));
  auto records = std::make_shared<const ZipDirectory>(std::move(directory));
  // The pickle is parsed where it lies in the map, as storages are bound.
  // Its CRC-32 is checked first (torch.load's reader does not): a damaged
  // pickle may still parse, into another object tree.
  const ZipRecord* pickle = records->Find("data.pkl");
  if (pickle == nullptr) {
    return Status::InvalidInput(name + " has no data.pkl; it is not a torch.save file");
  }
  const uint8_t* bytes = file->data() + pickle->data_offset;
  const size_t size = static_cast<size_t>(pickle->size);
  FetchExactly(bytes, size);
  if (Crc32(0, bytes, size) != pickle->crc) {
    return Status::InvalidInput(name + ": its data.pkl does not have the CRC-32 its zip directory "
                                "records; the file is damaged");
  }
  if (RecordCrcChecksOn()) WatchStorageRecords(*records, *file, window);
  PickleReader reader(options, MakeResolver(records, file));
  Result<Value> root = reader.Parse(bytes, size);
  if (!root.ok()) return root.status().WithContext(name);
  file->ReleasePages();  // the pickle's and the zip headers': a checkpoint has many files
  return root;
}

namespace {

// The storages reachable from `root` with their record keys, in the order
// the pickle names them.
Result<std::string> PickleWithStorages(
    const Value& root, std::vector<std::pair<std::string, const Storage*>>* storages) {
  return WritePickle(root, [storages](const std::string& key, const Storage& storage) {
    if (storage.bytes.data == nullptr && !storage.produce && storage.numel > 0) {
      return Status::Internal("storage " + key + " has no bytes bound");
    }
    storages->emplace_back(key, &storage);
    return Status::Ok();
  });
}

int64_t StorageBytes(const Storage& s) { return s.numel * ElementSize(s.dtype); }

// Bound bytes are copied a buffer at a time too, so that no source page
// stays mapped after its buffer (see CopyFromView).
ByteProducer CopyOf(const ByteView& bytes) {
  return ByteProducer::Traced([&bytes](int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
    TouchedPages pages;
    CopyFromView(bytes, bytes.data + offset, static_cast<size_t>(length), dst, &pages, spans);
    return Status::Ok();
  });
}

}  // namespace

Result<int64_t> TensorBytes(const Value& root) {
  std::vector<std::pair<std::string, const Storage*>> storages;
  RESHARD_RETURN_IF_ERROR(PickleWithStorages(root, &storages).status());
  int64_t total = 0;
  for (const auto& entry : storages) total += StorageBytes(*entry.second);
  return total;
}

Status WriteTorchFile(const std::string& path, const Value& root, const TorchWriteOptions& options) {
  std::vector<std::pair<std::string, const Storage*>> storages;
  Result<std::string> pickle = PickleWithStorages(root, &storages);
  if (!pickle.ok()) return pickle.status().WithContext(path);
  std::vector<uint8_t> own_buffer;
  std::vector<uint8_t>* buffer = options.buffer;
  if (buffer == nullptr || buffer->empty()) {
    own_buffer.resize(1 << 20);
    buffer = &own_buffer;
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<ZipWriter> zip, ZipWriter::Create(path));
  // torch.save's record order: the pickle first, then the storages.
  RESHARD_RETURN_IF_ERROR(zip->Add("data.pkl", reinterpret_cast<const uint8_t*>(pickle->data()),
                                   static_cast<int64_t>(pickle->size())));
  for (const auto& [key, storage] : storages) {
    const ByteProducer& produce = storage->produce ? storage->produce : CopyOf(storage->bytes);
    const ByteProducer counted =
        ByteProducer::Traced([&](int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
          RESHARD_RETURN_IF_ERROR(produce(offset, length, dst, spans));
          if (options.written) options.written(length);
          return Status::Ok();
        });
    Status st = zip->AddStreamed("data/" + key, StorageBytes(*storage), counted, buffer);
    // The zip writer's own I/O errors name the file already; a producer's do not.
    if (!st.ok()) return st.code() == Status::Code::kIoError ? st : st.WithContext(path);
  }
  RESHARD_RETURN_IF_ERROR(zip->Finish());
  if (options.digest != nullptr) *options.digest = {zip->bytes_written(), zip->file_crc()};
  return Status::Ok();
}

}  // namespace reshard
