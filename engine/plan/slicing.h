// Slice arithmetic along one split dimension.
//
// A split tensor's full extent along its split dim is cut into `parts`
// equal sub-parameters (SwiGLU halves, ...); each part is cut evenly over the
// TP ranks, and a rank's shard stacks its slice of every part. Re-sharding is
// then interval intersection between the source and target ranks' pieces.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/tensor_plan.h"

namespace reshard {

// A contiguous run of a shard along the split dim: full-tensor indices
// [full_start, full_start + length) stored at shard index local_start.
struct Piece {
  int64_t full_start = 0;
  int64_t local_start = 0;
  int64_t length = 0;
};

// The pieces TP rank `rank` of `tp` holds of a dim of `full` indices in `parts`
// parts. REQUIRES: full % (parts * tp) == 0.
std::vector<Piece> RankPieces(int64_t full, int parts, int tp, int rank);

// Copies filling the target pieces from the source ranks' pieces, limited to
// full indices below `available` (rows past it are left for fills).
std::vector<SliceCopy> IntersectPieces(const std::vector<Piece>& target,
                                       const std::vector<std::vector<Piece>>& source_by_rank,
                                       int dim, int64_t available);

// Fills for the target pieces' indices at or above `available`.
std::vector<SliceFill> FillsBeyond(const std::vector<Piece>& target, int dim, int64_t available,
                                   double value);

}  // namespace reshard
