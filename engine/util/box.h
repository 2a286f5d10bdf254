// Box: an N-dimensional block of a tensor's indices, an offset and a size per
// axis. A stored piece of a tensor (a TP slice, a vocabulary cut, one half of
// a fused SwiGLU, a Distributed Checkpoint chunk) is a box of the global
// tensor, and re-sharding is the intersection of boxes.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <vector>

namespace reshard {

struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  // The whole of a tensor of `shape`.
  static Box Whole(const std::vector<int64_t>& shape) {
    return Box{std::vector<int64_t>(shape.size(), 0), shape};
  }
  // `whole` with axis `axis` limited to [start, start + length).
  static Box Slab(const std::vector<int64_t>& shape, int axis, int64_t start, int64_t length) {
    Box box = Whole(shape);
    box.offsets[axis] = start;
    box.sizes[axis] = length;
    return box;
  }

  int rank() const { return static_cast<int>(sizes.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
  int64_t end(int axis) const { return offsets[axis] + sizes[axis]; }
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

// Where a stored piece of a tensor lies: the box `global` of the global
// tensor, whose first index sits at `local` in the stored (local) tensor.
struct Placement {
  Box global;
  std::vector<int64_t> local;
};

// The indices `a` and `b` (of equal rank) share, or nothing when they share none.
inline std::optional<Box> Intersect(const Box& a, const Box& b) {
  Box out = a;
  for (int i = 0; i < a.rank(); ++i) {
    const int64_t lo = a.offsets[i] > b.offsets[i] ? a.offsets[i] : b.offsets[i];
    const int64_t hi = a.end(i) < b.end(i) ? a.end(i) : b.end(i);
    if (lo >= hi) return std::nullopt;
    out.offsets[i] = lo;
    out.sizes[i] = hi - lo;
  }
  return out;
}

// How many distinct first indices along `axis` the `boxes` have: the cuts of
// a tensor along that axis, as its saved chunks show them (0: a box has no
// such axis).
inline int DistinctStartsAlong(const std::vector<Box>& boxes, int axis) {
  std::set<int64_t> starts;
  for (const Box& box : boxes) {
    if (axis < 0 || axis >= box.rank()) return 0;
    starts.insert(box.offsets[axis]);
  }
  return static_cast<int>(starts.size());
}

}  // namespace reshard
