#include "formats/megatron_core/common/megatron_param_groups.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "rules/rule_set.h"
#include "util/strings.h"

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

std::optional<double> AsNumber(const Value& v) {
  if (v.is(Value::Kind::kFloat)) return v.as_float();
  if (v.is(Value::Kind::kInt)) return static_cast<double>(v.as_int());
  return std::nullopt;
}

// A number the source's group records under `name`.
std::optional<double> Number(const OptimizerParamGroup& group, const char* name) {
  const Value* v = Find(group.hyperparameters, name);
  return v != nullptr ? AsNumber(*v) : std::nullopt;
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
// from the schedule where the source's group has none.
Value MegatronGroup(const OptimizerParamGroup& group, const Value& step, const LrSchedule& schedule,
                    bool default_config) {
  const Value& h = group.hyperparameters;
  Value out = Value::MakeDict();
  Set(out, "is_expert_parallel", Value::Bool(false));
  if (default_config) Set(out, "default_config", Value::Bool(true));
  Set(out, "wd_mult", Value::Float(group.weight_decay_multiplier));
  Set(out, "lr_mult", Hyper(h, "lr_mult", Value::Float(1.0)));
  Set(out, "is_decoupled_lr", Value::Bool(false));
  Set(out, "max_lr", Hyper(h, "max_lr", schedule.max_lr));
  Set(out, "min_lr", Hyper(h, "min_lr", schedule.min_lr));
  Set(out, "lr", Hyper(h, "lr", Value::None()));
  for (const char* name : {"betas", "eps", "weight_decay"}) Set(out, name, Hyper(h, name, Value::None()));
  for (const char* name : {"amsgrad", "maximize", "capturable", "differentiable"}) {
    Set(out, name, Hyper(h, name, Value::Bool(false)));
  }
  for (const char* name : {"foreach", "fused"}) Set(out, name, Hyper(h, name, Value::None()));
  Set(out, "step", step);
  return out;
}

// A bound of the schedule: its value, where it came from, the group key and
// the Megatron-LM flag and --set key that give it.
struct Bound {
  const Value& value;
  const std::string& from;
  const char* key;
  const char* flag;
  const char* set;
};

// Refuses a --set bound that contradicts a source group's own.
Status CheckGiven(const OptimizerParamGroup& group, const Bound& bound) {
  const Value* own = Find(group.hyperparameters, bound.key);
  if (own == nullptr || bound.value.is_none() || bound.from.rfind("--set", 0) != 0) return Status::Ok();
  if (AsNumber(*own) && AsNumber(bound.value) && *AsNumber(*own) == *AsNumber(bound.value)) return Status::Ok();
  return Status::InvalidInput(bound.from + "=" + bound.value.DebugString(20) + " contradicts the source's optimizer "
                              "param groups, which record " + bound.key + " " + own->DebugString(20) +
                              "; drop the --set");
}

// The notes on the bounds the groups took from the schedule: where each came
// from, and the ones no source gave, with how to give them.
void NoteBounds(const std::vector<Bound>& taken, std::vector<std::string>* notes) {
  std::vector<std::string> known, missing, resume;
  for (const Bound& b : taken) {
    if (b.value.is_none()) {
      missing.push_back(b.key);
      continue;
    }
    known.push_back(std::string(b.key) + " " + b.value.DebugString(20) + " (" + b.from + ")");
    resume.push_back(std::string(b.flag) + " " + b.value.DebugString(20));
  }
  if (!known.empty()) {
    notes->push_back("optimizer: the param groups' " + Join(known, ", ") + ", written into the args too: Megatron-Core "
                     "pairs saved groups with its own by them, so resume with " + Join(resume, " "));
  }
  if (missing.empty()) return;
  std::vector<std::string> fix, flags;
  for (const Bound& b : taken) {
    if (!b.value.is_none()) continue;
    fix.push_back(std::string("--set ") + b.set + "=<the run's " + b.flag + ">");
    flags.push_back(b.flag);
  }
  notes->push_back("optimizer: the source records no " + Join(missing, " or ") + " (the run's " + Join(flags, " and ") +
                   ") and none was given, so the param groups say None, which Megatron-Core's optimizer load of a "
                   "run with " + Join(flags, " and ") + " does not match (KeyError); give them: " + Join(fix, " "));
}

}  // namespace

LrSchedule RunLrSchedule(const Value& metadata, const Value& settings) {
  LrSchedule schedule;
  auto take = [&](const char* name, Value* value, std::string* from) {
    const std::string path = std::string("args.") + name;
    if (const Value* v = WalkPath(metadata, path); v != nullptr && AsNumber(*v)) {
      *value = Value::Float(*AsNumber(*v));
      *from = "the source's " + path;
    } else if (const Value* given = WalkPath(settings, path); given != nullptr && AsNumber(*given)) {
      *value = Value::Float(*AsNumber(*given));
      *from = std::string("--set ") + name;
    }
  };
  take("lr", &schedule.max_lr, &schedule.max_lr_from);
  take("min_lr", &schedule.min_lr, &schedule.min_lr_from);
  return schedule;
}

void WriteLrSchedule(const LrSchedule& schedule, Value* args) {
  if (!schedule.max_lr.is_none()) Set(*args, "lr", schedule.max_lr);
  if (!schedule.min_lr.is_none()) Set(*args, "min_lr", schedule.min_lr);
}

Result<Value> MegatronParamGroups(const OptimizerParamGroups& groups, const LrSchedule& schedule,
                                  const std::string& version, std::vector<std::string>* notes) {
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
  const std::vector<Bound> bounds = {{schedule.max_lr, schedule.max_lr_from, "max_lr", "--lr", "lr"},
                                     {schedule.min_lr, schedule.min_lr_from, "min_lr", "--min-lr", "min_lr"}};
  std::vector<Bound> taken;
  for (const Bound& b : bounds) {
    for (const auto& [mult, g] : by_mult) RESHARD_RETURN_IF_ERROR(CheckGiven(*g, b));
    const bool all_own = std::all_of(by_mult.begin(), by_mult.end(),
                                     [&](const auto& kv) { return Find(kv.second->hyperparameters, b.key) != nullptr; });
    if (!by_mult.empty() && !all_own) taken.push_back(b);
  }
  NoteBounds(taken, notes);
  std::vector<Value> out;
  for (const auto& [mult, g] : by_mult) {
    out.push_back(MegatronGroup(*g, step, schedule, version != "0.14"));
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
