// The only file of the engine that touches LibTorch: the zip container.
#include "format/torch_file.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <exception>
#include <memory>

#include "format/mapped_file.h"
#include "pickle/pickle_writer.h"

namespace reshard {
namespace {

constexpr char kZipMagic[] = "PK\x03\x04";

Status CheckZipMagic(const MappedFile& file) {
  if (file.size() < 4 || std::memcmp(file.data(), kZipMagic, 4) != 0) {
    return Status::InvalidInput(file.path() +
                                " is not a torch.save zip file (empty, truncated, or the legacy "
                                "pre-1.6 format); re-save it with torch.save");
  }
  return Status::Ok();
}

// Binds storages to their records inside the mapped file.
StorageResolver MakeResolver(caffe2::serialize::PyTorchStreamReader* zip,
                             std::shared_ptr<const MappedFile> file) {
  return [zip, file](const std::string& key, DType dtype, int64_t numel,
                     const std::string& location) -> Result<std::shared_ptr<Storage>> {
    auto storage = std::make_shared<Storage>();
    storage->dtype = dtype;
    storage->numel = numel;
    storage->location = location;
    storage->record_key = key;
    const std::string record = "data/" + key;
    if (numel < 0) return Status::InvalidInput(file->path() + ": negative storage size");
    const size_t nbytes = static_cast<size_t>(numel) * ElementSize(dtype);
    if (!zip->hasRecord(record)) {
      return Status::InvalidInput(file->path() + ": storage record '" + record +
                                  "' is missing; the file is truncated or damaged");
    }
    size_t offset = zip->getRecordOffset(record);
    if (offset > file->size() || nbytes > file->size() - offset) {
      return Status::InvalidInput(file->path() + ": storage '" + record +
                                  "' runs past the end of the file; the file is truncated");
    }
    storage->bytes = ByteView{file, file->data() + offset, nbytes};
    return storage;
  };
}

}  // namespace

Result<Value> ReadTorchFile(const std::string& path, const PickleReadOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  RESHARD_RETURN_IF_ERROR(CheckZipMagic(*file));
  try {
    caffe2::serialize::PyTorchStreamReader zip(path);
    if (!zip.hasRecord("data.pkl")) {
      return Status::InvalidInput(path + " has no data.pkl; it is not a torch.save file");
    }
    auto [pickle, size] = zip.getRecord("data.pkl");
    PickleReader reader(options, MakeResolver(&zip, file));
    Result<Value> root = reader.Parse(static_cast<const uint8_t*>(pickle.get()), size);
    if (!root.ok()) return root.status().WithContext(path);
    return root;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return Status::InvalidInput(path + " cannot be read as a torch.save zip file (" + what + ")");
  }
}

Status WriteTorchFile(const std::string& path, const Value& root) {
  try {
    caffe2::serialize::PyTorchStreamWriter zip(path);
    std::vector<std::pair<std::string, const Storage*>> storages;
    Result<std::string> pickle =
        WritePickle(root, [&](const std::string& key, const Storage& storage) {
          if (storage.bytes.data == nullptr && storage.numel > 0) {
            return Status::Internal("storage " + key + " has no bytes bound");
          }
          storages.emplace_back(key, &storage);
          return Status::Ok();
        });
    if (!pickle.ok()) return pickle.status().WithContext(path);
    // torch.save's record order: the pickle first, then the storages.
    zip.writeRecord("data.pkl", pickle->data(), pickle->size());
    for (const auto& [key, storage] : storages) {
      zip.writeRecord("data/" + key, storage->bytes.data, storage->bytes.size);
    }
    zip.writeEndOfFile();
  } catch (const std::exception& e) {
    std::string what = e.what();
    return Status::IoError("cannot write " + path + ": " + what.substr(0, what.find('\n')));
  }
  return Status::Ok();
}

}  // namespace reshard
