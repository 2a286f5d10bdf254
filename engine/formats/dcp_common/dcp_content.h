// A DCP checkpoint folder read once: its `.metadata`, every tensor item
// with its chunks read from the `.distcp` files (each chunk a SourceShard
// placed at its box of the global tensor, its bytes still in the file's
// memory map), and the keys of its bytes items. What the DCP source and the
// torch_dist import are built on.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "container/dcp_metadata.h"
#include "container/mapped_file.h"
#include "logical/source_shard.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

struct DcpTensor {
  std::string fqn;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> size;
  std::vector<SourceShard> shards;  // one per chunk, in .metadata order
};

struct DcpContent {
  std::string folder;
  bool torch_dist = false;  // Megatron-Core's (ReadTorchDistMarker)
  DcpMetadata meta;
  std::map<std::string, std::shared_ptr<const MappedFile>> files;  // by name in the folder
  std::vector<DcpTensor> tensors;        // in key order
  std::vector<std::string> bytes_items;  // keys, in order

  const DcpTensor* FindTensor(const std::string& fqn) const;
  // The plain object of bytes item `fqn` (InvalidInput naming the file when
  // it does not parse).
  Result<Value> ReadBytes(const std::string& fqn) const;
  // Every file of the checkpoint: `.metadata`, then the data files.
  std::vector<std::string> Paths() const;
};

// The elements of `t`, or of its slice `layer` along its first axis
// (layer >= 0), in row-major order as runs of its chunks' bytes: nothing is
// copied. A chunk's elements may lie in several runs (a piece assembled from
// others, such as an optimizer state cut out of flat buffers).
SourceShard SliceRuns(const DcpTensor& t, int64_t layer);
// Its slice at indices `lead` of its first axes ({layer, expert}).
SourceShard SliceRuns(const DcpTensor& t, const std::vector<int64_t>& lead);

// The name of a DCP checkpoint's metadata file.
inline constexpr char kDcpMetadataFile[] = ".metadata";

// Whether `folder` is Megatron-Core's `torch_dist`: its metadata.json says
// so. A folder without one is a plain DCP folder; a metadata.json that is not
// Megatron-Core's for torch_dist (not a regular file, not a JSON object,
// another backend or version) is InvalidInput naming it and the problem, as
// reading the folder as plain DCP would lose its model's layout silently.
Result<bool> ReadTorchDistMarker(const std::string& folder);

// The rank DCP's writer names a data file after (`__3_0.distcp`: 3); -1
// for another name.
int64_t RankOfDataFile(const std::string& name);

// The number of ranks that wrote `folder`: DCP's writer gives every rank
// its own `__<rank>_<i>.distcp` files, written even when empty. 0 when a
// data file is named otherwise or a rank is missing (who wrote is not known).
int WritingRanks(const std::string& folder);

// The iteration Megatron-LM names a checkpoint folder after (iter_0000010); 0 else.
int64_t IterationOfFolder(const std::string& folder);

// Reads `folder`'s `.metadata` and every chunk it lists, and its
// metadata.json. Errors (one line naming the file): a `.metadata` that does
// not parse or does not fit its files (chunks that do not tile their tensor,
// items outside their `.distcp` file, an item whose archive holds something
// other than its chunk); a metadata.json ReadTorchDistMarker refuses.
Result<DcpContent> ReadDcpContent(const std::string& folder);

}  // namespace reshard
