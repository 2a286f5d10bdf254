// Executor: writes the files a Plan describes into a folder.
//
// Target files are independent, so worker threads take them one at a time:
// each builds its tensors from the memory-mapped source shards and writes
// the file (optimizer shards: all DP ranks of one (pipeline, tensor) rank per
// job). Errors stop the remaining work; the caller discards the folder.
#pragma once

#include <functional>
#include <string>

#include "optim/source_optimizer.h"
#include "plan/plan.h"

namespace reshard {

struct ExecuteOptions {
  int threads = 1;
  bool drop_optimizer = false;  // see BuildModelStates
  // The source's optimizer state: written as shards when the plan says so, or
  // into the mp_rank files for the embedded FP16_Optimizer format.
  const SourceOptimizer* optimizer = nullptr;
  std::function<void(const std::string&)> progress;
};

struct ExecuteStats {
  int64_t files = 0;
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;
};

Result<ExecuteStats> ExecutePlan(const LogicalCheckpoint& src, const Plan& plan,
                                 const std::string& dir, const ExecuteOptions& options);

}  // namespace reshard
