// MemoryBudget: how a --max-memory budget is spent.
//
// A conversion's resident memory is what the process holds before writing
// (libraries, the checkpoint's pickled metadata, the plan) plus, per worker
// thread, its streaming buffer and the source pages read to fill it, which
// are released after every buffer. The budget left after the fixed part sets
// the buffer size; a budget the fixed part already uses up is refused with
// the figure that would do.
#pragma once

#include <cstdint>

#include "reshard/status.h"

namespace reshard {

struct MemoryBudget {
  int64_t budget = 0;    // bytes of resident memory allowed
  int64_t baseline = 0;  // resident when planned
  int threads = 1;
  int64_t buffer_bytes = 0;  // each worker's streaming buffer
  int64_t scratch_bytes = 0;  // each worker's memory beyond its buffer (a transpose's pieces)

  // Expected peak resident memory while writing.
  int64_t Estimate() const;

  // Splits what `budget` leaves after the current resident memory over
  // `threads` workers, each of which also holds `scratch_bytes`. The buffer
  // is `buffer_bytes` when that is set (> 0), else as big as the budget
  // allows up to 1 MiB: bigger buffers fall out of the CPU caches between
  // the copy into them and the write() out of them.
  static Result<MemoryBudget> Plan(int64_t budget, int threads, int64_t scratch_bytes = 0,
                                   int64_t buffer_bytes = 0);
};

// Resident memory of this process now, and its peak so far, in bytes.
int64_t ResidentBytes();
int64_t PeakResidentBytes();

}  // namespace reshard
