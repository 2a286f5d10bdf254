// The target mp_rank_XX_model_states.pt files: the source's metadata with
// everything that depends on the layout rewritten, so that the result loads
// in Megatron-DeepSpeed at the target layout.
//
// Rewritten: mp_world_size (TP*PP), dp_world_size, param_shapes and
// buffer_names of the target stage, args (parallel sizes, world size, padded
// vocabulary), checkpoint_info / universal_checkpoint_info padded vocabulary,
// checkpoint_parallel_dimensions, and universal_checkpoint_info's TP pattern
// lists when a TP-1 source (which has none) becomes TP > 1. Kept: iteration, scheduler, counters,
// configuration. RNG state: the source rank at the same (pipeline, tensor)
// position, else mp_rank_00's (the plan notes it).
#pragma once

#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "pickle/value.h"

namespace reshard {

// An embedded optimizer state (no ZeRO) becomes None when the plan
// drops it (weights only).
Value BuildModelStates(const LogicalCheckpoint& src, const DeepSpeedPlan& plan,
                       const ModelStatesPlan& ms);

// The mp_rank dict of a Megatron-DeepSpeed run that has not trained yet, at
// TP 1, PP 1, DP 1: the fields Megatron-DeepSpeed writes
// (megatron-deepspeed-format.md §9, §18.6), with no module, optimizer,
// scheduler or RNG state and its counters at 0. `run` is metadata another
// format read (args, iteration, the keys the rules read): its values take
// the place of those fields, its other keys follow. BuildModelStates then
// rewrites it for each target rank like a source's.
Value FreshRunModelStates(const Value& run);

}  // namespace reshard
