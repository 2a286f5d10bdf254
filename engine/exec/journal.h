// RunJournal: what a run has finished writing, so that the same command run
// again after the run was killed (SIGKILL, a crash, a lost node) reuses those
// files instead of writing them again.
//
// The journal is a file in the staging folder, `.reshard-journal`: a first
// line naming the run (a fingerprint of the command, the source files and
// the plan), then one line per finished job with the pieces it wrote and
// their CRCs, appended after the job's files are complete. A later run of
// the same fingerprint adopts the dead run's staging folder (OutputFolder)
// and skips each job whose pieces still read back with their CRCs; any other
// job is written again. The journal is removed before the folder is
// committed, so no output holds it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "exec/job.h"
#include "reshard/status.h"
#include "util/crc32.h"

namespace reshard {

inline constexpr char kJournalName[] = ".reshard-journal";

// A short, stable fingerprint of `text` (two independent hashes, hex).
std::string Fingerprint(const std::string& text);

// Whether `folder` holds the journal of a run with `fingerprint`.
bool HoldsJournalOf(const std::string& folder, const std::string& fingerprint);

class RunJournal {
 public:
  // Starts the journal in `folder` (which must not have one), by the one
  // process that made the folder.
  static Status Create(const std::string& folder, const std::string& fingerprint);
  // Opens the journal `folder` holds, reading the jobs it records.
  static Result<std::unique_ptr<RunJournal>> Open(const std::string& folder);

  RunJournal(const RunJournal&) = delete;
  RunJournal& operator=(const RunJournal&) = delete;
  ~RunJournal();

  // Takes out of `jobs` each job the journal records whose pieces read back
  // with their CRCs, and returns those pieces (file name, digest) for the
  // manifest; `bytes` learns how many bytes they are.
  std::vector<std::pair<std::string, FileDigest>> Reuse(std::vector<Job>* jobs, int64_t* bytes) const;

  // Makes each job append its line once it has finished. The journal must
  // outlive the jobs.
  void RecordWhenDone(std::vector<Job>* jobs);

  // Removes the journal file from `folder`.
  static Status Remove(const std::string& folder);

 private:
  using Pieces = std::vector<std::pair<std::string, FileDigest>>;
  RunJournal(std::string folder, int fd) : folder_(std::move(folder)), fd_(fd) {}
  void Append(const std::string& line);

  std::string folder_;
  int fd_ = -1;  // opened to append
  std::mutex mu_;
  std::map<std::pair<std::string, int>, Pieces> done_;  // (job name, part) -> its pieces
};

}  // namespace reshard
