#include "exec/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

namespace reshard {
namespace {

// Runs jobs 0..n-1 on `threads` workers (worker w gets w as its second
// argument); stops handing out work after the first failure and returns it.
Status RunParallel(size_t n, int threads, const std::function<Status(size_t, int)>& job) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first_error;
  auto worker = [&](int w) {
    for (size_t i = next++; i < n && !failed; i = next++) {
      Status st = job(i, w);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true)) first_error = st;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker, t);
    } catch (const std::system_error&) {
      break;  // the process may start no more threads: the ones running share the work
    }
  }
  worker(0);
  for (std::thread& t : pool) t.join();
  return first_error;
}

// Counts the bytes and the items done (the jobs of one name are one item,
// done when its last job is) and reports them about once a second, and once
// when the last job is done.
class ProgressCounter {
 public:
  ProgressCounter(const std::vector<Job>& jobs, const ExecuteOptions& options)
      : report_(options.progress), now_(ProgressBefore(jobs, options.unit)), jobs_left_(jobs.size()) {
    for (const Job& job : jobs) {
      if (job.counts_item) ++parts_left_[job.name];
    }
  }

  void AddBytes(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    now_.bytes_done += n;
    MaybeReport();
  }
  void JobDone(const Job& job) {
    std::lock_guard<std::mutex> lock(mu_);
    --jobs_left_;
    if (job.counts_item && --parts_left_[job.name] == 0) ++now_.done;
    MaybeReport();
  }

 private:
  using Clock = std::chrono::steady_clock;
  void MaybeReport() {
    if (!report_) return;
    now_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    if (jobs_left_ > 0 && now_.seconds < next_report_) return;
    next_report_ = now_.seconds + 1.0;
    report_(now_);
  }

  const ProgressCallback report_;
  std::map<std::string, int> parts_left_;  // of the items counted, by name
  Progress now_;
  size_t jobs_left_;
  std::mutex mu_;
  const Clock::time_point start_ = Clock::now();
  double next_report_ = 1.0;
};

}  // namespace

std::vector<Job> JobsOfRank(std::vector<Job> jobs, int rank, int ranks) {
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.name != b.name ? a.name < b.name : a.part < b.part;
  });
  std::vector<int64_t> load(std::max(1, ranks), 0);
  std::vector<int> rank_of(jobs.size());
  std::map<std::string, int> counted_by;  // item name -> the rank running its part 0
  for (size_t i = 0; i < jobs.size(); ++i) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += jobs[i].bytes + 1;  // + 1: empty jobs are spread too
    rank_of[i] = r;
    if (jobs[i].part == 0) counted_by[jobs[i].name] = r;
  }
  std::vector<Job> mine;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (rank_of[i] != rank) continue;
    jobs[i].counts_item = counted_by[jobs[i].name] == rank;
    mine.push_back(std::move(jobs[i]));
  }
  return mine;
}

int64_t JobBytes(const std::vector<Job>& jobs) {
  int64_t total = 0;
  for (const Job& job : jobs) total += job.bytes;
  return total;
}

Progress ProgressBefore(const std::vector<Job>& jobs, const std::string& unit) {
  std::set<std::string> items;
  for (const Job& job : jobs) {
    if (job.counts_item) items.insert(job.name);
  }
  Progress before;
  before.unit = unit;
  before.total = static_cast<int64_t>(items.size());
  before.bytes = JobBytes(jobs);
  return before;
}

Status Execute(std::vector<Job>& jobs, const ExecuteOptions& options) {
  ProgressCounter progress(jobs, options);
  // More workers than jobs would only hold buffers.
  const int threads = static_cast<int>(std::clamp<size_t>(static_cast<size_t>(std::max(1, options.threads)), 1,
                                                          std::max<size_t>(1, jobs.size())));
  std::vector<std::vector<uint8_t>> buffers(threads);
  auto run = [&](size_t i, int worker) -> Status {
    std::vector<uint8_t>& buffer = buffers[worker];
    buffer.resize(static_cast<size_t>(options.buffer_bytes));  // allocated when first used
    JobContext ctx{options.dir, buffer, [&progress](int64_t n) { progress.AddBytes(n); }, options.wrote};
    RESHARD_RETURN_IF_ERROR(jobs[i].run(ctx));
    jobs[i].run = nullptr;  // what it captured (source maps, trees) can go
    progress.JobDone(jobs[i]);
    return Status::Ok();
  };
  return RunParallel(jobs.size(), threads, run);
}

}  // namespace reshard
