// The learning-rate scheduler state a Megatron-LM resume reads: the common
// state's `opt_param_scheduler`, which Megatron-LM's load_checkpoint hands to
// OptimizerParamScheduler.load_state_dict right after the optimizer state (a
// missing one stops the load: "Unable to load optimizer").
//
// The source's own (a Megatron-LM run's opt_param_scheduler or a
// Megatron-DeepSpeed run's lr_scheduler, which the readers keep as the
// metadata's `lr_scheduler`) is carried as it is. Else it is made from the
// run, with the keys OptimizerParamScheduler.state_dict writes: max_lr and
// min_lr as the param groups take them (LrSchedule); num_steps, the samples
// trained, the iteration times args.global_batch_size (Megatron-LM steps the
// scheduler by the global batch); the warmup, decay and weight-decay values
// from the args Megatron-LM builds its scheduler from, else Megatron-LM's
// defaults. Its load asserts each of these but num_steps equals the resumed
// run's unless the run gives --override-opt-param-scheduler, so a note names
// every defaulted value and that flag. Without max_lr, min_lr or the global
// batch (of an iteration past 0) nothing is made, and a note says what is
// missing and the --set that gives it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/megatron_core/common/megatron_param_groups.h"
#include "pickle/value.h"

namespace reshard {

// The `opt_param_scheduler` to write for a source with `metadata`, --set
// `settings`, the param groups' `schedule` and `iteration`; nullopt (and a
// note) where it cannot be had.
std::optional<Value> SchedulerState(const Value& metadata, const Value& settings, const LrSchedule& schedule,
                                    int64_t iteration, std::vector<std::string>* notes);

}  // namespace reshard
