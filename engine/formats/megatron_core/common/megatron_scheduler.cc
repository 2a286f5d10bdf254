#include "formats/megatron_core/common/megatron_scheduler.h"

#include <algorithm>
#include <initializer_list>

#include "rules/rule_set.h"
#include "util/strings.h"

namespace reshard {
namespace {

// args.<name> as a number: the source's, else --set's.
std::optional<double> RunNumber(const Value& metadata, const Value& settings, const std::string& name) {
  for (const Value* root : {&metadata, &settings}) {
    const Value* v = WalkPath(*root, "args." + name);
    if (v == nullptr) continue;
    if (v->is(Value::Kind::kInt)) return static_cast<double>(v->as_int());
    if (v->is(Value::Kind::kFloat)) return v->as_float();
  }
  return std::nullopt;
}

// A scheduler state built from the run's values, noting those defaulted.
class MadeSchedule {
 public:
  MadeSchedule(const Value& metadata, const Value& settings) : metadata_(metadata), settings_(settings) {}

  std::optional<double> Arg(const std::string& name) const { return RunNumber(metadata_, settings_, name); }

  // args.<name>, else `fallback` (named in the note as Megatron-LM's default).
  std::string Text(const std::string& name, const std::string& fallback) {
    const Value* v = WalkPath(metadata_, "args." + name);
    if (v != nullptr && v->is(Value::Kind::kString)) return v->as_string();
    defaulted_.push_back(name + " '" + fallback + "'");
    return fallback;
  }

  // A count of samples: the first of `samples` the args give, else the
  // first of `iters` times the global batch, else `fallback` (noted, `why`).
  int64_t Samples(const char* key, std::initializer_list<const char*> samples,
                  std::initializer_list<const char*> iters, std::optional<double> batch, int64_t fallback,
                  const std::string& why) {
    for (const char* name : samples) {
      if (const std::optional<double> n = Arg(name); n && *n > 0) return static_cast<int64_t>(*n);
    }
    for (const char* name : iters) {
      if (const std::optional<double> n = Arg(name); n && *n > 0 && batch) return static_cast<int64_t>(*n * *batch);
    }
    defaulted_.push_back(std::string(key) + " " + std::to_string(fallback) + " (" + why + ")");
    return fallback;
  }

  double Decay(const char* name) {
    if (const std::optional<double> d = Arg(name)) return *d;
    if (const std::optional<double> d = Arg("weight_decay")) return *d;
    defaulted_.push_back(std::string(name) + " 0.01 (Megatron-LM's --weight-decay)");
    return 0.01;
  }

  const std::vector<std::string>& defaulted() const { return defaulted_; }

 private:
  const Value& metadata_;
  const Value& settings_;
  std::vector<std::string> defaulted_;
};

std::optional<Value> Made(const Value& metadata, const Value& settings, const LrSchedule& schedule,
                          int64_t iteration, std::vector<std::string>* notes) {
  MadeSchedule made(metadata, settings);
  const std::optional<double> batch = made.Arg("global_batch_size");
  std::vector<std::string> missing;
  if (schedule.max_lr.is_none()) missing.push_back("max_lr (--set lr=<the run's --lr>)");
  if (schedule.min_lr.is_none()) missing.push_back("min_lr (--set min_lr=<the run's --min-lr>)");
  if (iteration > 0 && !batch) {
    missing.push_back("num_steps, the samples trained: the iteration times the global batch (--set "
                      "global_batch_size=<the run's --global-batch-size>)");
  }
  if (!missing.empty()) {
    notes->push_back("opt_param_scheduler: the source records no learning-rate scheduler state and its " +
                     Join(missing, ", ") +
                     " cannot be had: none is written, and Megatron-LM loads the optimizer state only with it "
                     "(else with --no-load-optim or --finetune)");
    return std::nullopt;
  }
  const int64_t num_steps = iteration > 0 ? static_cast<int64_t>(iteration * *batch) : 0;
  const int64_t so_far = std::max<int64_t>(num_steps, 1);
  const std::string so_far_why = "the samples trained so far";
  const int64_t decay_steps = made.Samples("lr_decay_steps", {"lr_decay_samples", "train_samples"},
                                           {"lr_decay_iters", "train_iters"}, batch, so_far, so_far_why);
  Value warmup;
  if (const std::optional<double> fraction = made.Arg("lr_warmup_fraction")) {
    warmup = Value::Float(*fraction * static_cast<double>(decay_steps));
  } else {
    warmup = Value::Int(made.Samples("lr_warmup_steps", {"lr_warmup_samples"}, {"lr_warmup_iters"}, batch, 0,
                                     "no warmup, Megatron-LM's default"));
  }
  Value state = Value::MakeDict();
  Set(state, "max_lr", schedule.max_lr);
  Set(state, "lr_warmup_steps", std::move(warmup));
  Set(state, "num_steps", Value::Int(num_steps));
  Set(state, "lr_decay_style", Value::String(made.Text("lr_decay_style", "linear")));
  Set(state, "lr_decay_steps", Value::Int(decay_steps));
  Set(state, "min_lr", schedule.min_lr);
  Set(state, "start_wd", Value::Float(made.Decay("start_weight_decay")));
  Set(state, "end_wd", Value::Float(made.Decay("end_weight_decay")));
  Set(state, "wd_incr_style", Value::String(made.Text("weight_decay_incr_style", "constant")));
  Set(state, "wd_incr_steps", Value::Int(made.Samples("wd_incr_steps", {"train_samples"}, {"train_iters"}, batch,
                                                      so_far, so_far_why)));
  std::string note = "opt_param_scheduler: made from the run (the source records none): max_lr " +
                     schedule.max_lr.DebugString(20) + ", min_lr " + schedule.min_lr.DebugString(20) + ", num_steps " +
                     std::to_string(num_steps) +
                     (iteration > 0 ? " (iteration " + std::to_string(iteration) + " x global_batch_size " +
                                          std::to_string(static_cast<int64_t>(*batch)) + ")"
                                    : std::string(" (iteration 0)"));
  if (!made.defaulted().empty()) {
    note += "; defaulted: " + Join(made.defaulted(), ", ") +
            ": resume with --override-opt-param-scheduler, which takes these from the run's own flags (Megatron-LM "
            "otherwise requires each to equal the run's)";
  }
  notes->push_back(note);
  return state;
}

}  // namespace

std::optional<Value> SchedulerState(const Value& metadata, const Value& settings, const LrSchedule& schedule,
                                    int64_t iteration, std::vector<std::string>* notes) {
  const Value* own = Find(metadata, "lr_scheduler");
  if (own != nullptr && DictItems(*own) != nullptr && !DictItems(*own)->empty()) {
    const Value* steps = Find(*own, "num_steps");
    notes->push_back("opt_param_scheduler: the source's learning-rate scheduler state, carried" +
                     (steps != nullptr ? " (num_steps " + steps->DebugString(20) + ")" : std::string()));
    return *own;
  }
  return Made(metadata, settings, schedule, iteration, notes);
}

}  // namespace reshard
