// DeepSpeed's universal checkpoint, written from a checkpoint with ZeRO-1/2
// or BF16-optimizer shards (reference §14):
//
//   OUT/mp_rank_XX_model_states.pt      the source's, copied as they are
//   OUT/zero/optimizer_state.pt         the first shard's optimizer state without its
//                                       partitions, plus the groups' hyperparameters
//   OUT/zero/<param>/<state>.pt         {'param': the whole state tensor, layout keys}
//   OUT/zero/<param>/step.pt            the optimizer step, where there is one
//
// <param> is the engine's parameter name (`tied_modules.embed.word_embeddings.weight`,
// `3.mlp.dense_h_to_4h.weight`); <state> is fp32 (the master) and each
// per-element state (exp_avg, exp_avg_sq, ...). Layout keys tell DeepSpeed's
// loader how to cut the whole tensor for a TP rank: `cat_dim` for split
// tensors (1 for row-parallel ones, whatever the source TP), with
// `param_n_sub_params` for tensors of stacked sub-parameters, and
// `vocab_tensor` for vocabulary tensors, stored without padding rows;
// replicated tensors carry none. A non-pipeline checkpoint (HF Trainer,
// Accelerate) at TP 1 writes its parameters under the module's names,
// without layout keys: nothing is split. Every tensor is produced from the
// shards while its file is written.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/zero3/zero3_checkpoint.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "formats/format.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// The refusal for a checkpoint without `what` (its optimizer state).
Status NoStateForUniversal(const std::string& what);

// `src`, `opt` and `files` must outlive the plan and its jobs; `vocab_size`
// (--vocab-size) gives the true vocabulary where the source records none.
Result<OutputPlan> PlanUniversal(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                                  const CheckpointFiles& files, ReplicatedPolicy replicated,
                                                  std::optional<int64_t> vocab_size, std::vector<std::string>* notes);
// The same for a non-pipeline checkpoint at TP 1, its shapes from param_shapes.
// DeepSpeed's ZeRO-3 form, from a ZeRO-3 checkpoint at TP 1 (what its ZeRO-3
// loader reads): every model-states file copied; each parameter's states as
// bare flat tensors of its elements, no step.pt; zero/optimizer_state.pt is DP
// rank 0's optimizer state with the groups' hyperparameters as `param_groups`.
Result<OutputPlan> PlanUniversalUnsplit(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                                         const CheckpointFiles& files,
                                                         std::vector<std::string>* notes);
Result<OutputPlan> PlanUniversalZero3(const Zero3Checkpoint& src, const CheckpointFiles& files,
                                                       std::vector<std::string>* notes);

}  // namespace reshard
