#include "formats/megatron_core/common/megatron_param_groups.h"

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace reshard {
namespace {

// Megatron-Core records the step as a float in every group.
Result<Value> FloatStep(const std::optional<Value>& step) {
  if (!step) return Value::Float(0.0);
  if (step->is(Value::Kind::kFloat)) return *step;
  if (step->is(Value::Kind::kInt)) return Value::Float(static_cast<double>(step->as_int()));
  return Status::Unsupported("export --to torch_dist: the optimizer step " + step->DebugString(40) +
                             " is not a number; export with --weights-only");
}

// The value of hyperparameter `name`: the source's, else `fallback`; a
// list of betas becomes torch's tuple.
Value Hyper(const Value& hyper, const std::string& name, Value fallback) {
  const Value* v = Find(hyper, name);
  if (v == nullptr) return fallback;
  if (v->is(Value::Kind::kList)) return Value::MakeTuple(v->as_list().items);
  return *v;
}

// The source's weight decay of `group`, where it records a number.
std::optional<double> SourceDecay(const OptimizerParamGroup& group) {
  const Value* v = Find(group.hyperparameters, "weight_decay");
  if (v != nullptr && v->is(Value::Kind::kFloat)) return v->as_float();
  if (v != nullptr && v->is(Value::Kind::kInt)) return static_cast<double>(v->as_int());
  return std::nullopt;
}

// Whether Megatron-Core's scheduler applies less decay to `group` than the
// source did: it multiplies the decay by the group's multiplier.
bool DecayDropped(const OptimizerParamGroup& group) {
  const std::optional<double> decay = SourceDecay(group);
  return decay && *decay != 0.0 && group.weight_decay_multiplier != 1.0;
}

// A group's weight decay as Megatron-Core's scheduler applies it: the
// source's times the group's multiplier.
Value AppliedDecay(const OptimizerParamGroup& group) {
  if (!DecayDropped(group)) return Hyper(group.hyperparameters, "weight_decay", Value::None());
  return Value::Float(*SourceDecay(group) * group.weight_decay_multiplier);
}

// One Megatron-Core param group (default config: 0.19 says so, 0.14 not; no expert
// parallelism) from a source group's hyperparameters; max_lr and min_lr
// from the args where the source's group has none.
Value MegatronGroup(const OptimizerParamGroup& group, const Value& step, const Value* args, bool default_config) {
  const Value& h = group.hyperparameters;
  const Value* args_lr = args != nullptr ? Find(*args, "lr") : nullptr;
  const Value* args_min_lr = args != nullptr ? Find(*args, "min_lr") : nullptr;
  const Value lr = Hyper(h, "lr", Value::None());
  Value out = Value::MakeDict();
  Set(out, "is_expert_parallel", Value::Bool(false));
  if (default_config) Set(out, "default_config", Value::Bool(true));
  Set(out, "wd_mult", Value::Float(group.weight_decay_multiplier));
  Set(out, "lr_mult", Hyper(h, "lr_mult", Value::Float(1.0)));
  Set(out, "is_decoupled_lr", Value::Bool(false));
  Set(out, "max_lr", Hyper(h, "max_lr", args_lr != nullptr ? *args_lr : lr));
  Set(out, "min_lr", Hyper(h, "min_lr", args_min_lr != nullptr ? *args_min_lr : Value::None()));
  Set(out, "lr", lr);
  for (const char* name : {"betas", "eps"}) Set(out, name, Hyper(h, name, Value::None()));
  Set(out, "weight_decay", AppliedDecay(group));
  for (const char* name : {"amsgrad", "maximize", "capturable", "differentiable"}) {
    Set(out, name, Hyper(h, name, Value::Bool(false)));
  }
  for (const char* name : {"foreach", "fused"}) Set(out, name, Hyper(h, name, Value::None()));
  Set(out, "step", step);
  return out;
}

}  // namespace

Result<Value> MegatronParamGroups(const OptimizerParamGroups& groups, const Value* args, const std::string& version,
                                  std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(Value step, FloatStep(groups.step));
  std::map<double, const OptimizerParamGroup*, std::greater<double>> by_mult;
  for (const OptimizerParamGroup& g : groups.groups) {
    auto [it, fresh] = by_mult.emplace(g.weight_decay_multiplier, &g);
    if (!fresh && it->second->hyperparameters.DebugString(1 << 16) != g.hyperparameters.DebugString(1 << 16)) {
      return Status::Unsupported("export --to torch_dist: two optimizer groups with weight decay multiplier " +
                                 std::to_string(g.weight_decay_multiplier) + " differ in their hyperparameters, "
                                 "which Megatron-Core keeps in one group; export with --weights-only");
    }
  }
  std::vector<Value> out;
  for (const auto& [mult, g] : by_mult) {
    out.push_back(MegatronGroup(*g, step, args, version != "0.14"));
    if (DecayDropped(*g)) {
      notes->push_back("optimizer: the source decays its norms and biases too (weight_decay " +
                       Hyper(g->hyperparameters, "weight_decay", Value::None()).DebugString(20) +
                       "); Megatron-Core keeps them in its wd_mult 0 group, which its scheduler does not decay: that "
                       "group is written with weight_decay " + AppliedDecay(*g).DebugString(20) +
                       ", the decay a resumed run applies");
    }
  }
  return Value::MakeList(std::move(out));
}

}  // namespace reshard
