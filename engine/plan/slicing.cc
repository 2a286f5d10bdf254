#include "plan/slicing.h"

#include <algorithm>
#include <optional>

namespace reshard {
namespace {

// The target box a piece of `placement`'s global box `part` lands in.
Box LocalBox(const Placement& placement, const Box& part) {
  Box local = part;
  for (int i = 0; i < part.rank(); ++i) {
    local.offsets[i] = placement.local[i] + (part.offsets[i] - placement.global.offsets[i]);
  }
  return local;
}

}  // namespace

std::vector<BoxCopy> IntersectPlacements(const std::vector<Placement>& target,
                                         const std::vector<SourceShard>& sources, const Box& available) {
  std::vector<BoxCopy> copies;
  for (const Placement& t : target) {
    const std::optional<Box> wanted = Intersect(t.global, available);
    if (!wanted) continue;
    for (size_t shard = 0; shard < sources.size(); ++shard) {
      for (const Placement& s : sources[shard].placements) {
        const std::optional<Box> common = Intersect(*wanted, s.global);
        if (!common) continue;
        copies.push_back({static_cast<int>(shard), sources[shard].shape, LocalBox(s, *common).offsets,
                          LocalBox(t, *common)});
      }
    }
  }
  // Target order makes the writes sequential.
  std::sort(copies.begin(), copies.end(), [](const BoxCopy& a, const BoxCopy& b) {
    return a.dst.offsets < b.dst.offsets;
  });
  return copies;
}

// The part of each target placement outside `available` is cut into disjoint
// boxes, one per axis: for axis a, the indices inside `available` on every
// earlier axis, outside it on axis a (below or above), any on later axes.
std::vector<BoxFill> FillsOutside(const std::vector<Placement>& target, const Box& available,
                                  double value) {
  std::vector<BoxFill> fills;
  for (const Placement& t : target) {
    Box inside = t.global;  // narrowed axis by axis to `available`
    for (int a = 0; a < inside.rank(); ++a) {
      const int64_t lo = std::max(inside.offsets[a], available.offsets[a]);
      const int64_t hi = std::min(inside.end(a), available.end(a));
      const int64_t outside_at[2][2] = {{inside.offsets[a], std::min(lo, inside.end(a))},
                                        {std::max(hi, inside.offsets[a]), inside.end(a)}};
      for (const auto& [from, to] : outside_at) {
        if (from >= to) continue;
        Box part = inside;
        part.offsets[a] = from;
        part.sizes[a] = to - from;
        fills.push_back({LocalBox(t, part), value});
      }
      if (lo >= hi) break;  // nothing of this placement is inside
      inside.offsets[a] = lo;
      inside.sizes[a] = hi - lo;
    }
  }
  return fills;
}

}  // namespace reshard
