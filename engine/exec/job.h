// Job: one unit of streamed work — a file to write, a tensor to compare.
//
// The executor knows no format: a job is a name, its size in bytes (which
// orders the work, splits it between processes and drives progress) and a
// function that does it through the worker's buffer. Formats turn their
// plans into jobs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reshard/status.h"
#include "util/crc32.h"

namespace reshard {

// What a running job gets from its worker.
struct JobContext {
  const std::string& dir;           // the folder files are written into ("" when none)
  std::vector<uint8_t>& buffer;     // this worker's streaming buffer, at the budgeted size
  std::function<void(int64_t)> done;  // report bytes of progress
  // Report each file (or piece of one) written into `dir` (its name there)
  // with its digest, for the output's manifest; may be empty. Called from
  // the worker's thread.
  std::function<void(const std::string& name, const FileDigest& digest)> wrote;
};

struct Job {
  std::string name;   // a file's name in `dir`; breaks ties between equal sizes
  int64_t bytes = 0;  // the tensor bytes it streams
  std::function<Status(JobContext& ctx)> run;
  // A big file can be written by several jobs of the same name, each a byte
  // range of it, numbered from 0; each reports its piece's digest.
  int part = 0;
  // Whether this process counts the job's item (its name) in progress: of an
  // item whose parts several processes share, only the one running part 0
  // does, so that the processes' counts add up to the whole job's.
  bool counts_item = true;
};

}  // namespace reshard
