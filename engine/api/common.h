// Helpers shared by the command implementations in engine/api/.
#pragma once

#include <cstdint>

#include "reshard/reshard.h"

namespace reshard {

// `requested`, or the number of cores this process may use when it is 0.
int ThreadCount(int requested);

}  // namespace reshard
