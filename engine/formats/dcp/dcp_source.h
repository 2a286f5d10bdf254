// Any PyTorch Distributed Checkpoint folder as a source: a folder holding
// `.metadata` and its `.distcp` files, as torch's dcp.save, Megatron-Core's
// `torch_dist` and torchtitan write them.
//
// Without a rule set naming its keys, a DCP checkpoint is read as what it
// is: every tensor item whole under its key, assembled from its chunks (each
// chunk a SourceShard placed at its box of the global tensor, so any
// chunking plans the same way), and the bytes items (pickled plain objects)
// listed. `inspect`, `lint`, `verify` and `export --to consolidated` work
// on it; converting to another layout needs the rules of its model family.
#pragma once

#include <memory>
#include <string>

#include "formats/format.h"

namespace reshard {

// The DCP checkpoint `path` names: `path` itself when it holds a
// `.metadata` file, or the `iter_NNNNNNN` folder a Megatron-LM root's
// `latest_checkpointed_iteration.txt` names when that one does; "" when
// neither.
std::string DcpCheckpointFolder(const std::string& path);

// Opens the DCP checkpoint in `folder`. Errors (one line naming the file): a
// `.metadata` that does not parse or does not fit its files (chunks that do
// not tile their tensor, items outside their `.distcp` file, an item whose
// archive holds something other than its chunk).
Result<std::unique_ptr<SourceCheckpoint>> OpenDcpCheckpoint(const std::string& folder,
                                                            const CommonOptions& options);

}  // namespace reshard
