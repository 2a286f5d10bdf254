// Megatron-Core 0.19's optimizer param groups (or 0.14's, which lack
// `default_config`), made from a source's: what a
// torch_dist target writes beside the optimizer state (in the common state
// for fully_reshardable, in each rank's `optimizer` item for
// dp_reshardable).
//
// Megatron-Core keeps one group per weight-decay multiplier, decayed first
// (default config, no expert parallelism), each with its lr schedule bounds
// and torch's Adam fields, the step a float in every group. Its scheduler
// sets each group's weight_decay to the run's times wd_mult at every step,
// and Megatron-LM always puts norms and biases in the wd_mult 0 group (its
// load pairs saved and built groups by wd_mult), so a source that decays
// them (torchtitan) loses that decay: a note says so.
//
// Megatron-Core's optimizer load pairs each group it builds with a saved one
// by the group's identifier, whose schedule bounds are the run's --lr
// (max_lr) and --min-lr (min_lr): a saved group whose bounds are not the
// resumed run's is not found, and the load fails (KeyError), for its own
// saves as for reshard's. A source group's own bounds are kept (a Megatron-Core
// save's); others take the run's (LrSchedule), and a note says where each came
// from, or which is missing and how to give it.
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// The run's learning-rate schedule bounds: Megatron-LM's --lr (max_lr) and
// --min-lr (min_lr), each None where unknown, and where it came from ("the
// source's args.lr", "--set lr"; "" where unknown).
struct LrSchedule {
  Value max_lr = Value::None(), min_lr = Value::None();
  std::string max_lr_from, min_lr_from;
};

// The schedule from the source's `metadata` (its args) where recorded, else
// from the --set `settings`.
LrSchedule RunLrSchedule(const Value& metadata, const Value& settings);

// Sets args.lr and args.min_lr of `args` (dict-like) to the schedule's known
// values, so that the args say what the groups say.
void WriteLrSchedule(const LrSchedule& schedule, Value* args);

// The list of groups for `groups` as Megatron-Core `version` ("0.14" or
// "0.19") writes them; max_lr and min_lr from `schedule` where a source
// group has none (notes say where they came from, or that one is missing).
// A note says where a source group decays what Megatron-Core does not.
// Unsupported where two source groups of one multiplier differ, or the step
// is no number; InvalidInput where --set contradicts a group's own bound.
Result<Value> MegatronParamGroups(const OptimizerParamGroups& groups, const LrSchedule& schedule,
                                  const std::string& version, std::vector<std::string>* notes);

}  // namespace reshard
