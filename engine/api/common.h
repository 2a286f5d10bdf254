// Helpers shared by the command implementations in engine/api/.
#pragma once

#include <cstdint>
#include <optional>

#include "reshard/reshard.h"

namespace reshard {

class SourceCheckpoint;

// `requested`, or the number of cores this process may use when it is 0.
int ThreadCount(int requested);

// Refuses a --vocab-size that cannot be the checkpoint's: not positive, more
// rows than its vocabulary tensors hold, or another size than it records
// (rows past it would be taken for padding, or padding for tokens).
Status CheckVocabSize(const SourceCheckpoint& src, std::optional<int64_t> given);

}  // namespace reshard
