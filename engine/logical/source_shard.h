// SourceShard: one stored piece of a logical tensor, and where it came from.
//
// A logical tensor is assembled from shards: a weight from one file per TP
// rank, an optimizer state from the DP partitions it was flattened into. A
// shard is the tensor's local elements as contiguous runs of bytes inside
// the mapped source files, in element order; its local shape and where its
// parts lie in the global tensor (boxes, util/box.h); and its coordinates in
// the source's parallel grid, which name it in messages. Plans intersect
// placements and name shards by their index in a tensor's shard table, so a
// source that is not a TP file (a Distributed Checkpoint chunk, uneven or cut
// on several axes) adds placements, not planner code.
#pragma once

#include <cstdint>
#include <vector>

#include "container/mapped_file.h"
#include "pickle/value.h"
#include "util/box.h"

namespace reshard {

// Where a shard sits in the source's parallel grid.
struct ShardCoords {
  int tp = 0;
  int pp = 0;
  int dp = 0;  // the first DP rank holding part of it (optimizer partitions)
  int ep = 0;  // expert-parallel rank
};

struct SourceShard {
  struct Run {
    int64_t begin = 0;  // first element of the local tensor in this run
    int64_t numel = 0;
    ByteView bytes;     // numel elements
  };
  ShardCoords at;
  std::vector<int64_t> shape;          // its local tensor's
  std::vector<Placement> placements;   // of its local tensor in the global one
  std::vector<Run> runs;

  // One run: the elements of a contiguous tensor inside its storage (shape
  // set, no placement).
  static SourceShard Of(const Tensor& tensor, ShardCoords at);

  int64_t numel() const;
  // Copies elements [begin, begin + n) of `element_size` bytes each to `dst`
  // through CopyFromView (pages read from a mapping are noted in `pages`,
  // which may be null), and in `spans` what was copied from which file.
  void Copy(int64_t begin, int64_t n, int element_size, uint8_t* dst, TouchedPages* pages,
            const SpanSink& spans = {}) const;
  // The runs of elements [begin, begin + n) of `element_size` bytes each,
  // cut to them and numbered from 0: a piece of the shard, nothing copied.
  // REQUIRES: the shard holds them.
  std::vector<Run> RunsOf(int64_t begin, int64_t n, int element_size) const;
};

// The elements of a tensor of `shape`, or of its slice `layer` along its
// first axis (layer >= 0), in row-major order as runs of the bytes of
// `pieces`, each holding the boxes its placements give (a DCP chunk, a TP
// rank's piece of a split tensor): nothing is copied. Neighbouring runs in
// both the element order and the file are merged. REQUIRES: the placements
// tile the tensor (or the slice) without overlap.
SourceShard JoinRuns(const std::vector<SourceShard>& pieces, const std::vector<int64_t>& shape, int element_size,
                     int64_t layer);
// The same for its slice at indices `lead` of its first axes (a MoE layer's
// expert: {layer, expert}); empty `lead`: the whole tensor.
SourceShard JoinRuns(const std::vector<SourceShard>& pieces, const std::vector<int64_t>& shape, int element_size,
                     const std::vector<int64_t>& lead);

// First byte of a contiguous tensor's elements (inside its mapped storage).
const uint8_t* TensorData(const Tensor& t);

}  // namespace reshard
