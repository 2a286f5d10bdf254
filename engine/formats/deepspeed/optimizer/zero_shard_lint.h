// What lint and convert say about a DeepSpeed checkpoint's optimizer state.
#pragma once

#include <cstddef>
#include <string>

#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "reshard/reshard.h"

namespace reshard {

// The info finding for optimizer state that loaded and checked out: its
// format, groups and states.
Finding OptimizerFinding(const SourceOptimizer& opt, size_t shard_files);

// The note of a weights-only conversion of a checkpoint holding `what`, with
// how to resume from it.
std::string WeightsOnlyNote(const std::string& what);

}  // namespace reshard
