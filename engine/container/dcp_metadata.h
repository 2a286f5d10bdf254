// The `.metadata` file of a PyTorch Distributed Checkpoint (DCP, torch 2.6),
// read as plain data.
//
// A DCP checkpoint is a folder: `.metadata` (one pickle) and data files
// `__<rank>_<i>.distcp`. The metadata lists every item by its flattened key
// (FQN): a tensor (dtype, global size, and the chunks, N-dimensional boxes of
// it, that were written) or a bytes item (a pickled plain object), and says
// where each chunk or bytes item lies: a file of the folder, an offset and a
// length. The pickle is parsed with reshard's own reader and an allow-list of
// DCP's classes; Megatron-Core's own classes are read as inert records and
// ignored, any other is refused. Nothing is executed.
//
//   Result<DcpMetadata> meta = ReadDcpMetadata(folder + "/.metadata");
//   const DcpStorage* where = meta->Find("w", meta->items.at("w").chunks[0].offsets);
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "pickle/dtype.h"
#include "pickle/pickle_reader.h"
#include "reshard/status.h"
#include "util/box.h"

namespace reshard {

struct DcpItem {
  enum class Kind { kTensor, kBytes };
  Kind kind = Kind::kBytes;
  // Tensors only.
  DType dtype = DType::kFloat32;
  std::vector<int64_t> size;  // the global shape
  std::vector<Box> chunks;
};

// An entry of the storage index: an item's key and, for a tensor, the
// offsets of one of its chunks (empty for bytes items and 0-d tensors).
struct DcpStorageKey {
  std::string fqn;
  std::vector<int64_t> offsets;
  bool operator<(const DcpStorageKey& o) const {
    return fqn != o.fqn ? fqn < o.fqn : offsets < o.offsets;
  }
};

// Where an item's bytes are: [offset, offset + length) of a file of the
// checkpoint folder (a plain file name: the reader refuses paths).
struct DcpStorage {
  std::string relative_path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct DcpMetadata {
  std::map<std::string, DcpItem> items;  // by FQN
  // The FQNs as .metadata lists them: torch's save order, the first rank's
  // state dict (in its own order) first.
  std::vector<std::string> order;
  std::map<DcpStorageKey, DcpStorage> storage;
  // Megatron-Core 0.14's `mcore_data`: the original global shape of each
  // tensor it saved reformulated (`nd_reformulated_orig_global_shape`, an
  // optimizer state of its fully_sharded_model_space layout), by FQN.
  std::map<std::string, std::vector<int64_t>> nd_reformulated_orig_shapes;

  // The storage of `fqn`'s chunk at `offsets` (empty for a bytes item), or
  // null. ReadDcpMetadata checks that every chunk and bytes item has one.
  const DcpStorage* Find(const std::string& fqn, const std::vector<int64_t>& offsets) const;
};

// True when `chunk` is a box of a tensor of `size`: of its rank, inside it.
bool DcpChunkInside(const std::vector<int64_t>& size, const Box& chunk);

// Empty when the chunks of the tensor `item` tile it, as torch writes every
// element exactly once (replicas are saved by one rank): none overlaps
// another and together they hold all of it. Else what is wrong, for a
// message about `fqn`.
std::string DcpTilingProblem(const std::string& fqn, const DcpItem& item);

// The classes a DCP `.metadata` references (torch.distributed.checkpoint's
// metadata, filesystem and planner classes, torch's layout and memory-format
// encodings, pathlib's paths), with the calls torch's pickler makes of them.
const KnownClasses& DcpKnownClasses();

// The top-level packages of Megatron-Core and Megatron-LM, whose classes
// (MCoreSavePlan, the enums in args) sit beside the plain data of a DCP
// `.metadata`, a common state or a Megatron-LM rank file: read as inert
// records (PickleReadOptions::inert_packages), where any other unknown
// global is refused.
const std::set<std::string>& MegatronPackages();

// Reads and checks `path`. Errors (one line naming the file): InvalidInput
// for a file that is not a DCP metadata pickle or whose content does not fit
// (an unknown dtype, a chunk outside its tensor, a chunk or bytes item with
// no storage entry, an item listed twice, a storage path that leaves the
// folder), an empty or truncated file; Unsupported for
// what torch may write but reshard cannot read (stream transforms).
Result<DcpMetadata> ReadDcpMetadata(const std::string& path);

}  // namespace reshard
