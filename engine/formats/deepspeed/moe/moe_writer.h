// The files of a MoePlan (moe_plan.h), as an OutputPlan. Per target stage: its
// mp_rank file (the source metadata with the stage's module, its tensors
// copied as saved or cut for the target TP, its `_metadata` listing the
// stage's modules), its expert files (the source's, cut for the target TP
// when TP changes), its optimizer shards and one expp_rank file per target
// EP rank.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/moe/moe_optimizer.h"
#include "formats/deepspeed/moe/moe_plan.h"
#include "plan/output_plan.h"

namespace reshard {

// The plan's files; the arguments must outlive the plan.
Result<OutputPlan> MoeOutput(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeOptimizer* opt,
                             const std::set<std::string>& allowed_classes, const MoePlan& plan);

}  // namespace reshard
