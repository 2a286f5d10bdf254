// The per-group entries of a torch optimizer state_dict, which every DeepSpeed
// optimizer format nests somewhere: state_dict["state"][group index].
#pragma once

#include <string>
#include <vector>

#include "pickle/value.h"

namespace reshard {

// torch_state_dict["state"][group]; null when any level is missing.
const Value* TorchGroupState(const Value* torch_state_dict, int group);
Value* MutableTorchGroupState(Value* torch_state_dict, int group);

// torch_state_dict["param_groups"]; null when it is not a list.
const std::vector<Value>* ParamGroups(const Value& torch_state_dict);

// A comparable rendering of a small value; tensors by their bytes.
std::string ScalarBytes(const Value& v);
// A small value for messages; one-element tensors by their value.
std::string ScalarText(const Value* v);
// A contiguous fp32 tensor of `shape`, or null.
const Tensor* ParamTensor(const Value* v, const std::vector<int64_t>& shape);
// A torch param group's hyperparameters (everything but `params`), comparable.
std::string Hyperparameters(const Value& group);

}  // namespace reshard
