// Numbers formatted for people.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace reshard {

// "1.50 GiB", "3.20 MiB", "12.0 KiB"
std::string HumanBytes(int64_t bytes);

// "[4, 16]"
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace reshard
