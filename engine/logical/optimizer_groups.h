// How a rule set's `optimizer_groups` splits a model's parameters into the
// optimizer param groups Megatron builds: the ones that decay (the
// matrices), then the ones that do not (norms and biases, exactly the 1-D
// tensors). Every format that writes or reads param groups of such a run
// groups its parameters this way.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pickle/value.h"
#include "rules/rule_set.h"

namespace reshard {

// A parameter's name and its shape.
using ParamShape = std::pair<std::string, std::vector<int64_t>>;

// `params` (in registration order) in the groups of `scheme`, each keeping
// that order; empty groups are left out, but for kSplitDecay's three.
std::vector<std::vector<ParamShape>> GroupParams(const std::vector<ParamShape>& params, OptimizerGroups scheme);

// Whether the parameters of a group GroupParams made decay.
inline bool GroupDecays(const std::vector<ParamShape>& group) {
  return !group.empty() && group.front().second.size() >= 2;
}

// A torch param group's hyperparameters (lr, betas, weight_decay, ...): the
// group's string keys but its `params` and `step`.
Value GroupHyperparameters(const Value& group);

}  // namespace reshard
