// The classes DeepSpeed and Megatron-DeepSpeed checkpoints pickle beyond the
// generic ones (Python builtins, torch, NumPy) the pickle reader accepts by
// itself. Readers of these checkpoints pass them to it as
// PickleReadOptions::known_classes.
#pragma once

#include <set>
#include <string>

namespace reshard {

// "module.name" of each class. The set lives as long as the program.
const std::set<std::string>& DeepSpeedKnownClasses();

}  // namespace reshard
