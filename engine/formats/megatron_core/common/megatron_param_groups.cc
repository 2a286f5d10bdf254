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

// A number the source's group records under `name`.
std::optional<double> Number(const OptimizerParamGroup& group, const char* name) {
  const Value* v = Find(group.hyperparameters, name);
  if (v != nullptr && v->is(Value::Kind::kFloat)) return v->as_float();
  if (v != nullptr && v->is(Value::Kind::kInt)) return static_cast<double>(v->as_int());
  return std::nullopt;
}

// Whether Megatron-Core's scheduler, which sets a group's weight_decay to
// the run's times its wd_mult, decays `group` less than the source did (its
// weight_decay times its own wd_mult where it records one, as Megatron's
// groups do; torchtitan's decay every parameter).
bool DecayDropped(const OptimizerParamGroup& group) {
  const std::optional<double> decay = Number(group, "weight_decay");
  if (!decay) return false;
  const double applied = *decay * Number(group, "wd_mult").value_or(1.0);
  return applied > *decay * group.weight_decay_multiplier;
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
  for (const char* name : {"betas", "eps", "weight_decay"}) Set(out, name, Hyper(h, name, Value::None()));
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
                       "); Megatron-Core keeps them in its wd_mult 0 group, whose decay its scheduler sets to "
                       "weight_decay x wd_mult: a resumed run does not decay them");
    }
  }
  return Value::MakeList(std::move(out));
}

}  // namespace reshard
