// The per-group entries of a torch optimizer state_dict, which every DeepSpeed
// optimizer format nests somewhere: state_dict["state"][group index].
#pragma once

#include "pickle/value.h"

namespace reshard {

// torch_state_dict["state"][group]; null when any level is missing.
const Value* TorchGroupState(const Value* torch_state_dict, int group);
Value* MutableTorchGroupState(Value* torch_state_dict, int group);

}  // namespace reshard
