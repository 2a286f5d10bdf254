// Helpers shared by the command implementations in engine/api/.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "plan/output_plan.h"
#include "reshard/reshard.h"

namespace reshard {

class SourceCheckpoint;
class TorchCheck;

// What every command that opened `src` with `options` says: what reading it
// chose (SourceInfo::notes), and a note on the rule file it was given.
std::vector<std::string> OpenNotes(const SourceCheckpoint& src, const CommonOptions& options);

// `requested`, or the number of cores this process may use when it is 0.
int ThreadCount(int requested);

// Refuses a --vocab-size that cannot be the checkpoint's: not positive, more
// rows than its vocabulary tensors hold, or another size than it records
// (rows past it would be taken for padding, or padding for tokens).
Status CheckVocabSize(const SourceCheckpoint& src, std::optional<int64_t> given);

// Reads every record of every torch.save file (*.pt, *.bin) and of every
// item of a Distributed Checkpoint's `.distcp` files of `src` and checks it
// against its CRC-32, then has `torch` (LibTorch's reader; may be
// null) read the file too, a file per job on `threads` workers; each damaged
// file adds its one-line message to `damaged` (`lint --deep`, `verify --deep`).
Status CheckRecordCrcs(const SourceCheckpoint& src, int threads, const TorchCheck* torch,
                       const ProgressCallback& progress, std::vector<std::string>* damaged);

}  // namespace reshard
