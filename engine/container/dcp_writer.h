// Writing a PyTorch Distributed Checkpoint (DCP, as torch 2.6 writes one):
// `.distcp` data files and the `.metadata` that indexes them.
//
// Every byte of a `.distcp` file is placed before any is written
// (LayOutDcpFile): its items lie back to back, each a complete torch.save
// archive in torch 2.6's layout (the records `archive/data.pkl`,
// `archive/byteorder`, `archive/data/0` for a tensor, `archive/version` and
// `archive/.data/serialization_id`, with data descriptors and ZIP64 end
// records; its offsets relative to the item's first byte). So the
// `.metadata`, which records each item's file, offset and length, is made
// from the layouts alone (DcpMetadataPickle), and is written apart from the
// data files, and a big data file can be written as runs of items by
// several workers at once (WriteDcpItems).
//
// A tensor item's storage is exactly its chunk (contiguous, offset 0), as
// torch writes it; its bytes come from a ByteProducer a buffer at a time,
// their CRC-32 computed as they pass. A bytes item is a pickled plain object.
// ReadDcpMetadata and ReadDcpChunk (dcp_metadata.h, dcp_item.h) read back
// what these write.
//
//   Result<DcpFileLayout> file = LayOutDcpFile("__0_0.distcp",
//       {DcpTensorItem("w", DType::kFloat32, {4, 6}, {{2, 0}, {2, 6}}, produce),
//        DcpBytesItem("step", Value::Int(7))});
//   Result<std::string> metadata = DcpMetadataPickle({&*file});  // `.metadata`'s bytes
//   Result<FileDigest> d = WriteDcpItems(dir + "/__0_0.distcp", *file, 0, 2, &buffer, {});
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "container/dcp_metadata.h"
#include "container/zip_records.h"
#include "pickle/dtype.h"
#include "pickle/value.h"
#include "reshard/status.h"
#include "util/byte_producer.h"
#include "util/crc32.h"

namespace reshard {

// One item of a `.distcp` file. Make it with DcpTensorItem or DcpBytesItem.
struct DcpWriteItem {
  std::string fqn;  // its key in the checkpoint
  DcpItem::Kind kind = DcpItem::Kind::kTensor;
  // A tensor's chunk: the tensor's dtype and global size, the box of it
  // this item holds, and the box's bytes, row-major.
  DType dtype = DType::kFloat32;
  std::vector<int64_t> size;
  Box chunk;
  ByteProducer produce;
  // A bytes item: a plain object (no tensors).
  Value object;
  // The keys torch's dcp_to_torch_save nests the item under (`.metadata`'s
  // planner_data): strings, and ints for list indices (a state dict's
  // `param_groups`, 0); empty: {fqn}, a key of a flat state dict.
  std::vector<Value> path;
  // A tensor Megatron-Core 0.14 saved nd-reformulated: the original global
  // shape, which `.metadata`'s mcore_data records (empty: not reformulated).
  std::vector<int64_t> reformulated_from;
  // Where its elements come from, for `--dry-run` ("" when it is not said);
  // not written.
  std::string from;
};

DcpWriteItem DcpTensorItem(std::string fqn, DType dtype, std::vector<int64_t> size, Box chunk,
                           ByteProducer produce);
DcpWriteItem DcpBytesItem(std::string fqn, Value object);

// Where an item lies in its file, and its pickle (data.pkl).
struct DcpItemPlace {
  uint64_t offset = 0;
  uint64_t length = 0;
  std::string pickle;
};

// A `.distcp` file, every byte placed.
struct DcpFileLayout {
  std::string name;  // in the checkpoint folder: the metadata's relative_path
  std::vector<DcpWriteItem> items;
  std::vector<DcpItemPlace> places;  // one per item
  uint64_t size = 0;
  ZipStyle style;
};

struct DcpWriteOptions {
  // Records at or above this size are ZIP64's (tests lower it).
  uint64_t zip64_threshold = kZipMax32;
};

// Places `items`, in this order, in the file `name` (a plain file name).
// Errors: InvalidInput for a chunk outside its tensor or of another rank, a
// bytes item holding a tensor, a name that is not a plain file name.
Result<DcpFileLayout> LayOutDcpFile(std::string name, std::vector<DcpWriteItem> items,
                                    const DcpWriteOptions& options = {});

// The tensor bytes of items [first, last) of `layout`.
int64_t DcpTensorBytes(const DcpFileLayout& layout, size_t first, size_t last);

// Cuts the file into runs of whole items of about `part_bytes` (at least
// one run): item indices from 0 to the item count.
std::vector<size_t> DcpCuts(const DcpFileLayout& layout, int64_t part_bytes);

// Writes items [first, last) of `layout` into `path` at their offsets,
// creating the file if absent and never truncating it, their tensors
// streamed through `buffer`; `written` (may be empty) is told the tensor
// bytes as they are written. Returns the digest of the bytes written (at
// the first item's offset).
Result<FileDigest> WriteDcpItems(const std::string& path, const DcpFileLayout& layout, size_t first,
                                 size_t last, std::vector<uint8_t>* buffer,
                                 const std::function<void(int64_t)>& written);

struct DcpMetadataOptions {
  // Add Megatron-Core 0.14's `mcore_data` field: {fqn: {}} for every
  // tensor, {fqn: {'nd_reformulated_orig_global_shape': (dims)}} for one
  // written reformulated (DcpWriteItem::reformulated_from).
  bool mcore_data = false;
};

// The `.metadata` of a checkpoint made of `files`: every item with its
// chunks and where each is stored, as torch 2.6 pickles its Metadata.
// Errors: InvalidInput when the items of a key disagree (dtype, size, kind,
// original shape), a bytes item is written twice, or a tensor's chunks do
// not hold each of its elements once.
Result<std::string> DcpMetadataPickle(const std::vector<const DcpFileLayout*>& files,
                                      const DcpMetadataOptions& options = {});

}  // namespace reshard
