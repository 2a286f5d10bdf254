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
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// The list of groups for `groups` as Megatron-Core `version` ("0.14" or
// "0.19") writes them; max_lr and min_lr from `args` (may be null) where a
// source group has none. A note says where a source group decays what
// Megatron-Core does not. Unsupported where two source groups of one
// multiplier differ, or the step is no number.
Result<Value> MegatronParamGroups(const OptimizerParamGroups& groups, const Value* args, const std::string& version,
                                  std::vector<std::string>* notes);

}  // namespace reshard
