// Where a TP rank's shard of a rule-described tensor lies in the global
// tensor.
//
// A split rule cuts one axis: its extent is cut into `parts` equal
// sub-parameters (SwiGLU halves, fused QKV blocks, ...), each part cut evenly
// over the TP ranks, and a rank's shard stacks its slice of every part. A
// vocabulary tensor is cut by rows; a replicated one is whole on every rank.
#pragma once

#include <cstdint>
#include <vector>

#include "rules/rule_set.h"
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

// The local shape of TP rank `rank`'s shard of a tensor of global shape
// `full` that `rule` cuts over `tp` ranks, and where its parts lie.
struct TpPlacement {
  std::vector<int64_t> shape;
  std::vector<Placement> placements;
};
TpPlacement PlaceTpRank(const ParamRule& rule, const std::vector<int64_t>& full, int tp, int rank);

}  // namespace reshard
