// Writing the target optimizer shards of one (pipeline, tensor) rank.
//
// Every parameter's master weights and per-element optimizer states are
// re-sharded with the parameter's own tensor plan (its TP rule, vocabulary
// padding and replica policy, exactly as the weights), laid back to back in
// the target stage's parameter groups, aligned to 2·DP and cut into the
// target DP partitions. Each file is the source's shard with only the
// layout-dependent fields replaced, so loss scalers, hyperparameters, step
// counters and configuration are carried unchanged. A plain torch state
// (fp32 without ZeRO) takes each parameter's states as their own tensors,
// cut from the same flat layout, with param_groups re-indexed.
#pragma once

#include <atomic>
#include <string>

#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"

namespace reshard {

// The target optimizer state of one (pipeline, tensor) rank `plan`
// describes: for the sharded formats one file root per target DP rank (of
// `dp`; with MoE, the ranks d % plan.ep == plan.ep_rank, in order), made
// from the shard `like` (null: opt.Template()); for the embedded formats
// (FP16_Optimizer, torch) the single `optimizer` dict of its mp_rank file
// (a torch state_dict's groups are `like`'s).
// The flat tensors are produced from the source shards while they are
// written, adding the source bytes they read to *read, which must outlive them.
Result<std::vector<Value>> BuildOptimizerState(const SourceOptimizer& opt,
                                               const OptimizerStagePlan& plan, int dp,
                                               std::atomic<int64_t>* read, const Value* like = nullptr);

}  // namespace reshard
