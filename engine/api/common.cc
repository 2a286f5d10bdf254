#include "api/common.h"

#include <sched.h>

#include <algorithm>
#include <string>
#include <thread>

#include "formats/format.h"

namespace reshard {

int ThreadCount(int requested) {
  if (requested > 0) return requested;
  // The cores this process may run on: mpirun binds each rank to its own.
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1u, std::thread::hardware_concurrency());
}

Status CheckVocabSize(const SourceCheckpoint& src, std::optional<int64_t> given) {
  if (!given) return Status::Ok();
  const std::string what = "--vocab-size " + std::to_string(*given);
  if (*given < 1) return Status::InvalidInput(what + ": a vocabulary has at least one token");
  if (src.vocab_size() && *src.vocab_size() != *given) {
    return Status::InvalidInput(what + " contradicts the checkpoint, which records a vocabulary of " +
                                std::to_string(*src.vocab_size()) + "; drop --vocab-size");
  }
  if (src.vocab_rows() > 0 && *given > src.vocab_rows()) {
    return Status::InvalidInput(what + " exceeds the " + std::to_string(src.vocab_rows()) +
                                " rows of the checkpoint's vocabulary tensors");
  }
  return Status::Ok();
}

}  // namespace reshard
