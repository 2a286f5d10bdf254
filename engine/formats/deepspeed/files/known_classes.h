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

// Values of DeepSpeed's classes, pickled as DeepSpeed pickles them, for
// optimizer shards written from a source that has none to copy:
// fragment_address(numel, start), the ZeRO stage enum member of `stage`, and
// a static LossScaler of `scale`.
Value FragmentAddress(int64_t numel, int64_t start);
Value ZeroStage(int stage);
Value StaticLossScaler(double scale);

}  // namespace reshard
