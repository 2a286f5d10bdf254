// Megatron-LM's tracker file, latest_checkpointed_iteration.txt: the one
// checkpoint folder of a root it names. Both Megatron formats keep one in
// their roots (torch_dist's iter_N is also a DCP folder), so the DCP reader
// follows it as the Megatron readers do.
#pragma once

#include <string>

#include "reshard/status.h"

namespace reshard {

// The folder of Megatron-LM's root `root` that its tracker file
// `latest_checkpointed_iteration.txt` names: iter_0000010 for "10",
// "release" for "release"; "" when `root` has no tracker. Refused (naming
// the file and what it holds) when the tracker is not a regular file or
// holds anything else.
Result<std::string> MegatronTrackedFolder(const std::string& root);

}  // namespace reshard
