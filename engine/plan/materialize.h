// Building target tensor bytes from source shards, by element range.
//
// A TensorPlan says which slices of which source TP ranks' shards fill a
// target tensor. Materialising any range of the target's elements needs only
// the matching source elements, so a writer can produce a tensor of any size
// a buffer at a time, and an optimizer partition can take just the part of a
// parameter that falls inside it.
#pragma once

#include <cstdint>
#include <vector>

#include "container/mapped_file.h"
#include "plan/plan.h"

namespace reshard {

// One source TP rank's local tensor as contiguous runs of elements, in order:
// a weight is one run inside its layer file; an optimizer state is cut
// across the DP partitions it was flattened into.
struct SourceShard {
  struct Run {
    int64_t begin = 0;  // first element of the local tensor in this run
    int64_t numel = 0;
    ByteView bytes;  // numel elements
  };
  std::vector<Run> runs;

  // Copies elements [begin, begin + n) of `element_size` bytes each to `dst`.
  void Copy(int64_t begin, int64_t n, int element_size, uint8_t* dst, TouchedPages* pages) const;
};

// What a tensor plan reads: every source TP rank's shard of one tensor.
struct SourceTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> local_shape;  // the same on every TP rank
  std::vector<SourceShard> shards;   // by source TP rank

  static SourceTensor Of(const LogicalTensor& t);
};

// Writes elements [begin, end) of the target tensor `plan` describes (in
// row-major order, src.dtype) to `dst`. Returns the source bytes read.
// Mapped source pages read are noted in `pages`.
int64_t MaterializeRange(const SourceTensor& src, const TensorPlan& plan, int64_t begin,
                         int64_t end, uint8_t* dst, TouchedPages* pages);

// The whole target tensor into `out`.
int64_t MaterializeTensor(const LogicalTensor& t, const TensorPlan& plan, std::vector<uint8_t>* out);

}  // namespace reshard
