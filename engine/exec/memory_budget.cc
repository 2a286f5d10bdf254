#include "exec/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "util/human.h"

namespace reshard {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGranule = 64 << 10;
// Pickles, zip headers, thread stacks and allocator slack while writing.
constexpr int64_t kSlack = 48 * kMiB;
// Per worker: the buffer, the source pages read into it, and block-sized
// scratch space (averages, dtype casts).
constexpr int64_t kBuffersPerWorker = 2;
constexpr int64_t kScratchPerWorker = 1 * kMiB;
constexpr int64_t kMinBuffer = 256 << 10;
constexpr int64_t kMaxBuffer = 1 * kMiB;
constexpr int64_t kMinAskedBuffer = 4 << 10;  // a page

}  // namespace

int64_t MemoryBudget::Estimate() const {
  return baseline + kSlack + threads * (kBuffersPerWorker * buffer_bytes + kScratchPerWorker + scratch_bytes);
}

Result<MemoryBudget> MemoryBudget::Plan(int64_t budget, int threads, int64_t scratch_bytes,
                                        int64_t buffer_bytes) {
  MemoryBudget m;
  m.budget = budget;
  m.baseline = ResidentBytes();
  m.threads = std::max(1, threads);
  m.scratch_bytes = scratch_bytes;
  if (buffer_bytes > 0) {
    if (buffer_bytes < kMinAskedBuffer || buffer_bytes % kMinAskedBuffer != 0) {
      return Status::InvalidInput("--buffer-size " + HumanBytes(buffer_bytes) +
                                  " is not a multiple of 4 KiB; pass e.g. 256KiB or 1MiB");
    }
    m.buffer_bytes = buffer_bytes;
    if (m.Estimate() > budget) {
      return Status::InvalidInput("--buffer-size " + HumanBytes(buffer_bytes) + " needs about " +
                                  HumanBytes(m.Estimate()) + " with " + std::to_string(m.threads) +
                                  " thread(s), more than --max-memory " + HumanBytes(budget) +
                                  "; raise --max-memory or pass a smaller --buffer-size");
    }
    return m;
  }
  const int64_t per_worker = (budget - m.baseline - kSlack) / m.threads - kScratchPerWorker - scratch_bytes;
  const int64_t buffer = std::min(kMaxBuffer, per_worker / kBuffersPerWorker) / kGranule * kGranule;
  if (buffer < kMinBuffer) {
    m.buffer_bytes = kMinBuffer;
    return Status::InvalidInput(
        "--max-memory " + HumanBytes(budget) + " is too small: reshard holds " +
        HumanBytes(m.baseline) + " after reading the checkpoint's metadata, and " +
        std::to_string(m.threads) + " worker thread(s) need more" +
        (scratch_bytes > 0 ? " (each holds up to " + HumanBytes(scratch_bytes) + " beside its buffer)" : "") +
        "; allow at least " +
        HumanBytes(m.Estimate()) + " or pass fewer --threads");
  }
  m.buffer_bytes = buffer;
  return m;
}

int64_t ResidentBytes() {
  long pages_total = 0, pages_resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  const bool ok = std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) == 2;
  std::fclose(f);
  return ok ? static_cast<int64_t>(pages_resident) * ::sysconf(_SC_PAGESIZE) : 0;
}

int64_t PeakResidentBytes() {
  // VmHWM, not getrusage: ru_maxrss also counts the parent's memory, which a
  // forked child holds until it execs reshard.
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
  }
  std::fclose(f);
  return static_cast<int64_t>(kb) * 1024;
}

}  // namespace reshard
