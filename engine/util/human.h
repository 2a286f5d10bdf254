// Numbers formatted for people.
#pragma once

#include <cstdint>
#include <string>

namespace reshard {

// "1.50 GiB", "3.20 MiB", "12.0 KiB"
std::string HumanBytes(int64_t bytes);

}  // namespace reshard
