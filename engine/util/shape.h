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

}  // namespace reshard
