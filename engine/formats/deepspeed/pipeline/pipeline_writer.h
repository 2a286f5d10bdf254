// A DeepSpeedPlan's files, as the OutputPlan convert prints and writes.
//
// Each file's pickled tree is the source file's (so container types, key
// order and fields reshard does not know are kept) with its big tensors
// produced from the memory-mapped source shards while the file is written,
// a buffer at a time. Nothing is read until the file is written.
#pragma once

#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "logical/logical_checkpoint.h"
#include "plan/output_plan.h"

namespace reshard {

// `src` and `opt` (null without optimizer state) must outlive the plan.
Result<OutputPlan> DeepSpeedOutput(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                   const DeepSpeedPlan& plan);

}  // namespace reshard
