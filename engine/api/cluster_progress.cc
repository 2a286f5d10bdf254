#include "api/cluster_progress.h"

#include <algorithm>
#include <sstream>
#include <thread>
#include <utility>

namespace reshard {
namespace {

// How long rank 0, its own jobs done, waits between looks for posts.
constexpr std::chrono::milliseconds kPollInterval{20};

// Seconds between two shows of the sum (the executor's pace).
constexpr double kShowInterval = 1.0;

}  // namespace

ProgressSum::ProgressSum(std::vector<Progress> before) : ranks_(std::move(before)), last_(ranks_.size(), false) {}

std::string ProgressSum::Post(const Progress& mine, bool last) {
  return std::to_string(mine.done) + " " + std::to_string(mine.bytes_done) + (last ? " last" : "");
}

void ProgressSum::Take(int rank, const std::string& post) {
  if (rank < 0 || rank >= static_cast<int>(ranks_.size())) return;
  std::istringstream in(post);
  int64_t done = 0, bytes_done = 0;
  if (!(in >> done >> bytes_done)) return;
  std::string word;
  in >> word;
  ranks_[rank].done = done;
  ranks_[rank].bytes_done = bytes_done;
  last_[rank] = word == "last";
}

bool ProgressSum::AllLast() const { return std::all_of(last_.begin(), last_.end(), [](bool last) { return last; }); }

Progress ProgressSum::Sum(double seconds) const {
  Progress whole;
  if (!ranks_.empty()) whole.unit = ranks_[0].unit;
  for (const Progress& rank : ranks_) {
    whole.done += rank.done;
    whole.total += rank.total;
    whole.bytes_done += rank.bytes_done;
    whole.bytes += rank.bytes;
  }
  if (!AllLast() && whole.total > 0) whole.done = std::min(whole.done, whole.total - 1);
  whole.seconds = seconds;
  return whole;
}

ClusterProgress::ClusterProgress(Cluster* cluster, ProgressCallback show)
    : cluster_(cluster), show_(std::move(show)) {
  if (cluster_ == nullptr || cluster_->size() == 1) return;
  const Status can = cluster_->CanPostFromAnyThread();
  posting_ = can.ok();
  if (!posting_ && cluster_->rank() == 0 && show_) {
    note_ = "the progress shown is rank 0's share of the work only: " + can.message();
  }
}

Status ClusterProgress::Begin(const Progress& mine) {
  mine_ = mine;
  start_ = Clock::now();
  if (!posting_) return Status::Ok();
  // Every rank's totals, for rank 0's; the others need none.
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> totals,
                           cluster_->AllGather(std::to_string(mine.total) + " " + std::to_string(mine.bytes)));
  if (cluster_->rank() != 0) return Status::Ok();
  std::vector<Progress> before(totals.size(), mine);
  Status parsed = Status::Ok();
  for (size_t r = 0; r < totals.size(); ++r) {
    std::istringstream in(totals[r]);
    if (!(in >> before[r].total >> before[r].bytes) && parsed.ok()) {
      parsed = Status::Internal("rank " + std::to_string(r) + " sent totals that do not parse: '" + totals[r] + "'");
    }
  }
  sum_.emplace(std::move(before));  // even so: Finish still waits for every rank's last post
  return parsed;
}

ProgressCallback ClusterProgress::Callback() {
  if (!posting_) return show_;
  return [this](const Progress& mine) { Report(mine); };
}

void ClusterProgress::Report(const Progress& mine) {
  mine_ = mine;
  if (cluster_->rank() != 0) {
    cluster_->Post(ProgressSum::Post(mine, /*last=*/false), /*wait=*/false);
    return;
  }
  sum_->Take(0, ProgressSum::Post(mine, /*last=*/false));
  TakePostsAndShow(/*now=*/true);
}

void ClusterProgress::Finish() {
  if (!posting_) return;
  if (cluster_->rank() != 0) {
    // Waits until it is sent: rank 0 receives until it has every rank's last.
    cluster_->Post(ProgressSum::Post(mine_, /*last=*/true), /*wait=*/true);
    return;
  }
  sum_->Take(0, ProgressSum::Post(mine_, /*last=*/true));
  for (;;) {
    TakePostsAndShow(/*now=*/false);
    if (sum_->AllLast()) return;
    std::this_thread::sleep_for(kPollInterval);
  }
}

void ClusterProgress::TakePostsAndShow(bool now) {
  for (const auto& [rank, post] : cluster_->Received()) sum_->Take(rank, post);
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  if (!show_ || !(now || sum_->AllLast() || seconds >= next_show_)) return;
  next_show_ = seconds + kShowInterval;
  show_(sum_->Sum(seconds));
}

}  // namespace reshard
