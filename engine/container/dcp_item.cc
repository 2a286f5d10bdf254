#include "container/dcp_item.h"

#include <utility>

#include "container/torch_file.h"
#include "container/zip_directory.h"

namespace reshard {

Result<Value> ReadDcpItem(std::shared_ptr<const MappedFile> file, const DcpStorage& storage) {
  const FileWindow window{storage.offset, storage.length};
  RESHARD_RETURN_IF_ERROR(file->CheckWindow(window));
  return ReadTorchArchive(std::move(file), window);
}

Result<Value> ReadDcpChunk(std::shared_ptr<const MappedFile> file, const DcpMetadata& meta,
                           const std::string& fqn, const Box& chunk) {
  auto item = meta.items.find(fqn);
  const DcpStorage* storage = meta.Find(fqn, chunk.offsets);
  if (item == meta.items.end() || item->second.kind != DcpItem::Kind::kTensor ||
      storage == nullptr) {
    return Status::InvalidInput(file->path() + ": no tensor chunk of '" + fqn + "' is stored there");
  }
  const std::string where = file->Name(FileWindow{storage->offset, storage->length});
  RESHARD_ASSIGN_OR_RETURN(Value value, ReadDcpItem(file, *storage));
  // torch clones a view before writing it, so the stored tensor is the chunk
  // exactly; anything else is not what the metadata describes.
  const bool fits = value.is(Value::Kind::kTensor) &&
                    value.as_tensor().storage->dtype == item->second.dtype &&
                    value.as_tensor().sizes == chunk.sizes && value.as_tensor().IsContiguous();
  if (!fits) {
    return Status::InvalidInput(where + ": the chunk of '" + fqn + "' holds " +
                                value.DebugString(80) + ", not the contiguous " +
                                DTypeName(item->second.dtype) + " tensor its .metadata describes");
  }
  return value;
}

Status CheckDcpItemCrcs(const MappedFile& file, const std::string& name, const DcpMetadata& meta) {
  for (const auto& [key, storage] : meta.storage) {
    if (storage.relative_path != name) continue;
    RESHARD_ASSIGN_OR_RETURN(ZipDirectory items, ZipDirectory::Read(file, FileWindow{storage.offset, storage.length}));
    RESHARD_RETURN_IF_ERROR(items.CheckCrcs(file));
  }
  return Status::Ok();
}

}  // namespace reshard
