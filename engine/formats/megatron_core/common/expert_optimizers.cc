#include "formats/megatron_core/common/expert_optimizers.h"

#include <algorithm>

namespace reshard {
namespace {

// The weight-decay multipliers of the source groups holding a parameter
// that `expert` says is (or is not) an expert's.
std::set<double> MultipliersOf(const OptimizerParamGroups& source, const std::set<std::string>& experts, bool expert) {
  std::set<double> mults;
  for (const OptimizerParamGroup& g : source.groups) {
    const bool holds = std::any_of(g.params.begin(), g.params.end(),
                                   [&](const std::string& p) { return (experts.count(p) > 0) == expert; });
    if (holds) mults.insert(g.weight_decay_multiplier);
  }
  return mults;
}

// The groups of `megatron_groups` whose wd_mult is one of `mults`, flagged
// expert-parallel for the experts' optimizer.
Value GroupsOf(const Value& megatron_groups, const std::set<double>& mults, bool expert_parallel) {
  std::vector<Value> out;
  for (const Value& group : megatron_groups.as_list().items) {
    const Value* mult = Find(group, "wd_mult");
    if (mult == nullptr || mults.count(mult->as_float()) == 0) continue;
    out.push_back(group);
    Set(out.back(), "is_expert_parallel", Value::Bool(expert_parallel));
  }
  return Value::MakeList(std::move(out));
}

// `group` with the flag Megatron-Core sets on the groups of the experts'
// optimizer cleared.
Value AsDense(Value group) {
  Set(group, "is_expert_parallel", Value::Bool(false));
  return group;
}

std::string WdMult(const Value& group) {
  const Value* mult = Find(group, "wd_mult");
  return mult != nullptr ? mult->DebugString(20) : "None";
}

}  // namespace

Result<std::vector<Value>> ParamGroupsAsOneOptimizer(const std::vector<Value>& groups) {
  std::vector<Value> out;
  std::vector<std::string> texts;
  for (const Value& group : groups) {
    Value dense = AsDense(group);
    const std::string text = dense.DebugString(1 << 16);
    if (std::find(texts.begin(), texts.end(), text) != texts.end()) continue;
    for (const Value& kept : out) {
      if (WdMult(kept) != WdMult(dense)) continue;
      return Status::Unsupported("the experts' optimizer param group with wd_mult " + WdMult(dense) +
                                 " differs from the dense parameters' in more than is_expert_parallel, and "
                                 "reshard keeps one group per wd_mult");
    }
    texts.push_back(text);
    out.push_back(std::move(dense));
  }
  return out;
}

std::vector<Value> ParamGroupsPerOptimizer(const Value& megatron_groups, const OptimizerParamGroups& source,
                                           const std::set<std::string>& experts, int ep) {
  if (experts.empty() || ep == 1) return {megatron_groups};
  return {GroupsOf(megatron_groups, MultipliersOf(source, experts, false), false),
          GroupsOf(megatron_groups, MultipliersOf(source, experts, true), true)};
}

}  // namespace reshard
