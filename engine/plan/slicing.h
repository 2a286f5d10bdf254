// Re-sharding as box arithmetic.
//
// Every stored piece of a tensor is a box of the global tensor placed at an
// offset of its shard (util/box.h, Placement). Planning a target shard is
// then the intersection of its placements with every source shard's, plus
// fills for what no source holds (new vocabulary padding).
//
// A split rule cuts one axis: its extent is cut into `parts` equal
// sub-parameters (SwiGLU halves, ...), each part cut evenly over the TP
// ranks, and a rank's shard stacks its slice of every part (RankPieces).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/tensor_plan.h"
#include "util/box.h"

namespace reshard {

// A contiguous run of a shard along the split axis: full-tensor indices
// [full_start, full_start + length) stored at shard index local_start.
struct Piece {
  int64_t full_start = 0;
  int64_t local_start = 0;
  int64_t length = 0;
};

// The pieces TP rank `rank` of `tp` holds of an axis of `full` indices in
// `parts` parts. REQUIRES: full % (parts * tp) == 0.
std::vector<Piece> RankPieces(int64_t full, int parts, int tp, int rank);

// The placements of `pieces` cut along `axis` of a shard of `local_shape`,
// whole along every other axis.
std::vector<Placement> PlacementsOf(const std::vector<Piece>& pieces,
                                    const std::vector<int64_t>& local_shape, int axis);

// Copies filling the target's placements from every source shard's
// placements (indexed by shard), limited to the global box `available` (what
// the source holds; the rest is left for fills); in target order.
std::vector<BoxCopy> IntersectPlacements(const std::vector<Placement>& target,
                                         const std::vector<std::vector<Placement>>& source_by_shard,
                                         const Box& available);

// Fills, with `value`, the target placements' indices outside `available`.
std::vector<BoxFill> FillsOutside(const std::vector<Placement>& target, const Box& available,
                                  double value);

}  // namespace reshard
