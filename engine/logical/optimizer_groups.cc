#include "logical/optimizer_groups.h"

namespace reshard {

std::vector<std::vector<ParamShape>> GroupParams(const std::vector<ParamShape>& params, OptimizerGroups scheme) {
  std::vector<ParamShape> decay, no_decay;
  for (const ParamShape& p : params) (p.second.size() >= 2 ? decay : no_decay).push_back(p);
  std::vector<std::vector<ParamShape>> groups;
  if (scheme == OptimizerGroups::kSplitDecay) {
    // BigScience splits the decay group in two halves (an apex workaround).
    const size_t half = decay.size() / 2;
    groups.emplace_back(decay.begin(), decay.begin() + half);
    groups.emplace_back(decay.begin() + half, decay.end());
    groups.push_back(no_decay);
    return groups;
  }
  if (!decay.empty()) groups.push_back(decay);
  if (!no_decay.empty()) groups.push_back(no_decay);
  return groups;
}

Value GroupHyperparameters(const Value& group) {
  Value out = Value::MakeDict();
  for (const auto& [key, value] : *DictItems(group)) {
    if (!key.is(Value::Kind::kString) || key.as_string() == "params" || key.as_string() == "step") continue;
    Set(out, key.as_string(), value);
  }
  return out;
}

}  // namespace reshard
