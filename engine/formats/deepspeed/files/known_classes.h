// The classes DeepSpeed and Megatron-DeepSpeed checkpoints pickle beyond the
// generic ones (Python builtins, torch, NumPy) the pickle reader accepts by
// itself, each with what it is (an enum and its members, or a plain class),
// which decides the calls a pickle may make of it. Readers of these
// checkpoints pass them to it as PickleReadOptions::known_classes.
#pragma once

#include "pickle/pickle_reader.h"

namespace reshard {

// The set lives as long as the program.
const KnownClasses& DeepSpeedKnownClasses();

}  // namespace reshard
