// The checkpoint inside a folder that no format reads as it is: a root
// holding the checkpoint folders of Megatron-LM (iter_NNNNNNN, release) or
// torchtitan (step-N), as `export --to megatron`, `--to torch_dist` and
// `--to torchtitan` write them, without a pointer that names one of them.
//
// A root that holds one such checkpoint is read as that checkpoint; one that
// holds several, or whose latest_checkpointed_iteration.txt names none of
// them, is refused in one line naming the folders to pass instead, rather
// than with the DeepSpeed reader's "not a tag folder". So is a DeepSpeed
// root without `latest` (its tag folders; the one its `latest_universal`
// names): a root given as a DeepSpeed source is read through `latest` alone,
// as convert then writes a root. Only the names and the files that mark a
// checkpoint are looked at; nothing is read whole.
//
// It sits in formats/ itself because it asks several format folders
// whether a folder is theirs.
#pragma once

#include <string>

#include "reshard/status.h"

namespace reshard {

// "" when `path` is not such a root (or holds DeepSpeed's `latest`): the
// caller reads it as it is. The one checkpoint folder inside it when there
// is exactly one and no latest_checkpointed_iteration.txt names another, or
// the one that file names. Else InvalidInput naming the folders to pass.
Result<std::string> CheckpointInsideRoot(const std::string& path);

}  // namespace reshard
