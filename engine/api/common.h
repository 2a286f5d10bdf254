// Helpers shared by the command implementations in engine/api/.
#pragma once

#include <memory>
#include <string>

#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"
#include "util/human.h"

namespace reshard {

// Loads the checkpoint of `files` with the rule set and class allow-list of `options`.
Result<std::unique_ptr<LogicalCheckpoint>> LoadForCommand(CheckpointFiles files,
                                                          const CommonOptions& options);

// `requested`, or the number of cores this process may use when it is 0.
int ThreadCount(int requested);

// "bigscience-bloom (numbering default), TP 2, PP 2, DP 2, iteration 20, ..."
std::string LayoutSummary(const LogicalCheckpoint& ckpt);

}  // namespace reshard
