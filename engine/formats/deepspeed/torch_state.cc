#include "formats/deepspeed/torch_state.h"

namespace reshard {

const Value* TorchGroupState(const Value* torch_state_dict, int group) {
  const Value* state = torch_state_dict != nullptr ? Find(*torch_state_dict, "state") : nullptr;
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  if (items == nullptr) return nullptr;
  for (const auto& [k, v] : *items) {
    int64_t g;
    if (ReadInt(k, &g) && g == group) return &v;
  }
  return nullptr;
}

Value* MutableTorchGroupState(Value* torch_state_dict, int group) {
  return const_cast<Value*>(TorchGroupState(torch_state_dict, group));
}

}  // namespace reshard
