// ClusterProgress: the whole job's progress, shown on rank 0, when several
// processes share the jobs (`mpirun -np N`).
//
// Each process runs its share of the jobs (JobsOfRank) with an executor of
// its own, whose progress reaches only that process. The other ranks post
// their counts to rank 0 as their executors report them (about once a
// second; Cluster::Post, which never waits and drops a post while the last
// one is still on its way), and rank 0 shows its own counts plus the latest
// it has from every other rank against the whole job's totals. When its own
// jobs are done, rank 0 goes on showing until every rank has posted its last
// counts, so that the last line is the whole job's.
//
// Alone, or when the MPI library lets only one thread call it, there are no
// posts: each process's callback is its own `show`, and rank 0 shows its share.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "reshard/cluster.h"
#include "reshard/progress.h"

namespace reshard {

// The whole job's progress from every rank's latest counts.
class ProgressSum {
 public:
  // Each rank's progress before its jobs ran (ProgressBefore), in rank order.
  explicit ProgressSum(std::vector<Progress> before);

  // What a rank posts: its counts, and whether they are its last (all its
  // jobs have run).
  static std::string Post(const Progress& mine, bool last);
  // Takes rank `rank`'s post; one that does not parse is ignored.
  void Take(int rank, const std::string& post);

  // Whether every rank's last counts are in.
  bool AllLast() const;
  // The sum of every rank's latest, `seconds` into the work. Until every
  // rank's last counts are in, it is not finished: a file whose parts several
  // ranks write counts as done on the rank writing its part 0, which may be
  // done before the others.
  Progress Sum(double seconds) const;

 private:
  std::vector<Progress> ranks_;
  std::vector<bool> last_;
};

class ClusterProgress {
 public:
  // `cluster`: null when alone. `show`: where rank 0 shows progress (may be empty).
  ClusterProgress(Cluster* cluster, ProgressCallback show);

  // Every rank calls it before its jobs run, with where they stand
  // (ProgressBefore): a collective when ranks post.
  Status Begin(const Progress& mine);
  // For ExecuteOptions::progress; valid while this object lives.
  ProgressCallback Callback();
  // Every rank calls it once its jobs have run, whether or not they
  // succeeded: the others post their last counts; rank 0 waits for them all,
  // showing progress meanwhile, and shows the end.
  void Finish();

  // On rank 0 with a `show`: "" when it shows the whole job's progress, else
  // why it shows only its own share.
  const std::string& note() const { return note_; }

 private:
  using Clock = std::chrono::steady_clock;
  void Report(const Progress& mine);
  // Takes the posts that arrived, and shows the sum when it is due (`now`:
  // whatever the time).
  void TakePostsAndShow(bool now);

  Cluster* const cluster_;
  const ProgressCallback show_;
  bool posting_ = false;  // whether ranks post to rank 0
  std::string note_;
  Progress mine_;  // this rank's latest
  std::optional<ProgressSum> sum_;  // rank 0's, when posting
  Clock::time_point start_ = Clock::now();
  double next_show_ = 1.0;  // seconds from start_
};

}  // namespace reshard
