// What lint says about replicated tensors whose TP copies differ: the
// weights' and the optimizer state's drift, largest first, as severe as
// convert would be under the lint options' --replicated policy.
#pragma once

#include "formats/deepspeed/source_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

// Replicated weights that differ across TP ranks.
void ReportDrift(const LogicalCheckpoint& ckpt, const LintOptions& options, LintReport* report);

// Replicated parameters whose masters or moments differ across TP ranks:
// convert refuses them under `check`, as it refuses drifted weights.
void ReportStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt,
                      const LintOptions& options, LintReport* report);

}  // namespace reshard
