// Executor: writes the files a Plan describes into a folder.
//
// Every target file becomes a job: its pickled tree, whose big tensors are
// produced from the memory-mapped source shards while the file is written, a
// buffer at a time. Worker threads take the largest jobs first. Memory stays
// at one streaming buffer per worker (plus the source pages it reads, which
// are released after each buffer), whatever the checkpoint's size. Errors
// stop the remaining work; the caller discards the folder.
//
// Several processes (an MPI job) split the jobs deterministically by size:
// each runs the same plan with its own `rank`, and together they write every
// file exactly once, byte for byte what one process writes.
#pragma once

#include <functional>
#include <string>

#include "optim/source_optimizer.h"
#include "plan/plan.h"

namespace reshard {

struct ExecuteOptions {
  int threads = 1;
  int64_t buffer_bytes = 1 << 20;  // each worker's streaming buffer
  bool drop_optimizer = false;     // see BuildModelStates
  // The source's optimizer state: written as shards when the plan says so, or
  // into the mp_rank files for the embedded FP16_Optimizer format.
  const SourceOptimizer* optimizer = nullptr;
  // This process's share of the files: jobs assigned to `rank` of `ranks`.
  int rank = 0, ranks = 1;
  // Receives a progress line (files, bytes, rate, ETA) about once a second.
  std::function<void(const std::string&)> progress;
};

// What executing a plan writes (in this process).
struct ExecuteStats {
  int64_t files = 0;
  int64_t tensor_bytes = 0;   // tensor data written
  int64_t bytes_written = 0;  // file sizes
  int64_t bytes_read = 0;     // source tensor data read
};

// The files and tensor bytes ExecutePlan would write, without writing
// (what --dry-run reports). bytes_written and bytes_read are 0.
Result<ExecuteStats> MeasurePlan(const LogicalCheckpoint& src, const Plan& plan,
                                 const ExecuteOptions& options);

Result<ExecuteStats> ExecutePlan(const LogicalCheckpoint& src, const Plan& plan,
                                 const std::string& dir, const ExecuteOptions& options);

}  // namespace reshard
