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

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/deepspeed/zero_shard_reader.h"
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

// What Execution::Write moved.
struct ExecuteStats {
  int64_t bytes_written = 0;  // file sizes
  int64_t bytes_read = 0;     // source tensor data read
};

struct PreparedFile;  // one target file's tree and size (executor.cc)

// The files of a plan that this process writes, prepared once: their trees,
// sizes and producers. Preparing reads no tensor data, so its figures are
// what --dry-run reports; Write then streams exactly these files.
class Execution {
 public:
  static Result<std::unique_ptr<Execution>> Prepare(const LogicalCheckpoint& src, const Plan& plan,
                                                   const ExecuteOptions& options);
  ~Execution();

  int64_t files() const;
  int64_t tensor_bytes() const;

  // Writes every file into `dir`. Call it once.
  Result<ExecuteStats> Write(const std::string& dir);

 private:
  explicit Execution(const ExecuteOptions& options);

  ExecuteOptions options_;
  std::vector<PreparedFile> files_;
  std::atomic<int64_t> read_{0};  // producers add the source bytes they read
};

}  // namespace reshard
