// A DeepSpeed source optimizer's param groups and step as the format seam
// gives them (SourceCheckpoint::ParamGroupsAndStep): each group's
// hyperparameters from the optimizer's own state dict, its members as the
// rule set's optimizer_groups make them (what the shard writers use), by
// canonical name.
#pragma once

#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "formats/format.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// The groups of `opt`, whose template holds the torch param groups, over the
// model `ckpt`. The members are those of a single stage holding the whole
// model (a split decay group is split in two halves of the model's matrices).
// Errors: a template without param groups, or with another number of groups
// than the rule set makes.
Result<OptimizerParamGroups> SourceParamGroups(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt);

}  // namespace reshard
