// The optimizer state of a model another format read (logical/
// imported_optimizer.h: a Megatron-Core torch_dist checkpoint's distributed
// optimizer) as a SourceOptimizer: what convert --to deepspeed writes
// DeepSpeed's optimizer shards from, and export --to universal its
// per-parameter files.
//
// The target format is the one a Megatron-DeepSpeed run of the same
// precision uses with a DP-sharded optimizer, as Megatron-Core's distributed
// optimizer is:
//   bf16 weights     BF16_Optimizer (bf16_zero_pp_rank_* files)
//   fp32 weights     DeepSpeedZeroOptimizer, ZeRO stage 1 (zero_pp_rank_*),
//                    a static loss scale of 1
//   fp16 weights     refused: Megatron-Core's loss scaler is not carried.
// A state without fp32 masters (a bf16 FSDP run's AdamW) is refused too.
// The shards' hyperparameters are the source's param groups (decayed groups
// first, as the rule sets' decay_no_decay groups are), the step is each
// group's state's, clip_grad is args.clip_grad (Megatron's default 1.0 where
// the args do not record it).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "logical/imported_optimizer.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// `imported` over `ckpt` (the imported model, TP 1, PP 1), which must
// outlive it. Errors: a weight without state, fp16 weights, no masters.
// Notes the DeepSpeed optimizer it becomes and what its shards take that the
// source does not record (for a DeepSpeed target).
Result<std::unique_ptr<SourceOptimizer>> MakeImportedOptimizer(ImportedOptimizer imported,
                                                               const LogicalCheckpoint& ckpt,
                                                               std::vector<std::string>* notes);

}  // namespace reshard
