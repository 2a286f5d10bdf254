// Re-sharding as box arithmetic.
//
// Every stored piece of a tensor is a box of the global tensor placed at an
// offset of its shard (util/box.h, Placement). Planning a target shard is
// then the intersection of its placements with every source shard's, plus
// fills for what no source holds (new vocabulary padding). Where a format's
// pieces lie is the format's business (logical/tp_placement.h for rules cut
// over TP ranks).
#pragma once

#include <cstdint>
#include <vector>

#include "logical/source_shard.h"
#include "plan/tensor_plan.h"
#include "util/box.h"

namespace reshard {

// Copies filling the target's placements from every source shard's
// placements, limited to the global box `available` (what the source holds;
// the rest is left for fills); in target order.
std::vector<BoxCopy> IntersectPlacements(const std::vector<Placement>& target,
                                         const std::vector<SourceShard>& sources, const Box& available);

// Fills, with `value`, the target placements' indices outside `available`.
std::vector<BoxFill> FillsOutside(const std::vector<Placement>& target, const Box& available,
                                  double value);

}  // namespace reshard
