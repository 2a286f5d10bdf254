#include "util/human.h"

#include <cstdio>

namespace reshard {

std::string HumanBytes(int64_t n) {
  char buf[32];
  if (n >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", n / double(int64_t{1} << 30));
  } else if (n >= (int64_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", n / double(int64_t{1} << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", n / 1024.0);
  }
  return buf;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace reshard
