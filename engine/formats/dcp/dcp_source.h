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

#include "formats/dcp_common/dcp_content.h"
#include "formats/format.h"

namespace reshard {

// The DCP checkpoint `path` names: `path` itself when it holds a
// `.metadata` file, or the `iter_NNNNNNN` folder a Megatron-LM root's
// `latest_checkpointed_iteration.txt` names when that one does; "" when
// neither.
std::string DcpCheckpointFolder(const std::string& path);

// The DCP checkpoint `content` as what it is, without a rule set;
// `why_no_rules` (may be empty) says why no rule set describes it.
std::unique_ptr<SourceCheckpoint> OpenDcpCheckpoint(DcpContent content, std::string why_no_rules);

}  // namespace reshard
