// Tensor shapes as lists of dimension sizes.
#pragma once

#include <cstdint>
#include <vector>

namespace reshard {

// Elements of a tensor of `shape` (1 for a 0-d tensor).
inline int64_t ShapeNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// More elements than any tensor has (2^62, exbibytes of data). A shape read
// from a file whose count is above it, or a group of shapes whose total is,
// is malformed; counts up to it leave sums and paddings room in int64.
inline constexpr int64_t kMaxElements = int64_t{1} << 62;

// The elements of `shape`, or -1 when a dim is negative or the count is
// above kMaxElements: for shapes read from a file.
inline int64_t CheckedShapeNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) return -1;
    n *= d;
  }
  return n;
}

}  // namespace reshard
