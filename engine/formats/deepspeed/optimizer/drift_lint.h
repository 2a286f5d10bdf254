// Replicated tensors whose TP copies differ: what lint says of the weights'
// and the optimizer state's drift, largest first, as severe as convert would
// be under the lint options' --replicated policy; and convert's own check
// before it merges TP copies.
#pragma once

#include <string>
#include <vector>

#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

// Replicated weights that differ across TP ranks.
void ReportDrift(const LogicalCheckpoint& ckpt, const LintOptions& options, LintReport* report);

// Replicated parameters whose masters or moments differ across TP ranks:
// convert refuses them under `check`, as it refuses drifted weights.
void ReportStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt,
                      const LintOptions& options, LintReport* report);

// Applies the replicated-tensor policy to the weights: refuses drift under
// `check`; `notes` learns what `average` / `first` will merge.
Status CheckWeightDrift(const LogicalCheckpoint& ckpt, ReplicatedPolicy policy, std::vector<std::string>* notes);

// Under `check`, replicated parameters' optimizer state must agree across
// TP ranks too (masters and moments drift like the weights).
Status CheckStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt, ReplicatedPolicy policy);

}  // namespace reshard
