// Executor: runs jobs on worker threads, largest first.
//
// Every job streams its bytes through its worker's buffer, so memory stays at
// one buffer per worker (plus the source pages a buffer reads, which the jobs
// release after each one), whatever the checkpoint's size. Errors stop
// handing out work; the first one is returned.
//
// Several processes (an MPI job) split the jobs deterministically by size:
// each calls JobsOfRank with its own rank on the same list, and together they
// run every job exactly once.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "exec/job.h"
#include "reshard/progress.h"

namespace reshard {

struct ExecuteOptions {
  int threads = 1;
  int64_t buffer_bytes = 1 << 20;  // each worker's streaming buffer
  std::string dir;                 // passed to every job
  // Receives where the jobs stand about once a second, and when the last is done.
  ProgressCallback progress;
  std::string unit = "files";  // what the jobs' names count (jobs of one name are one)
  // JobContext::wrote of every job (called from the worker threads).
  std::function<void(const std::string& name, const FileDigest& digest)> wrote;
};

// The jobs process `rank` of `ranks` runs: largest first (names break ties,
// so every process orders the same way), each to the process with the fewest
// bytes so far. Still largest first, which also balances the threads. Sets
// Job::counts_item.
std::vector<Job> JobsOfRank(std::vector<Job> jobs, int rank, int ranks);

int64_t JobBytes(const std::vector<Job>& jobs);

// Where `jobs` stand before any has run: nothing done of the items they count
// (Job::counts_item) and of their bytes. Execute reports progress from there.
Progress ProgressBefore(const std::vector<Job>& jobs, const std::string& unit);

// Runs `jobs` in order on `options.threads` workers.
Status Execute(std::vector<Job>& jobs, const ExecuteOptions& options);

}  // namespace reshard
