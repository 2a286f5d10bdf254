#include "exec/executor.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

#include "formats/deepspeed/model_states_writer.h"
#include "container/torch_file.h"
#include "formats/deepspeed/zero_shard_writer.h"
#include "formats/deepspeed/state_tensor.h"
#include "util/human.h"

namespace reshard {

// One target file: its tree (big tensors produced while written) and size.
struct PreparedFile {
  std::string name;
  Value root;
  int64_t tensor_bytes = 0;
};

namespace {

Result<PreparedFile> LayerFile(const LogicalCheckpoint& src, const LayerFilePlan& file,
                               const SourceOptimizer* optimizer, std::atomic<int64_t>* read) {
  const LogicalLayer& layer = src.layers[file.layer_index];
  PreparedFile job{file.name, layer.roots[0]};  // the source's container type, key order and extras
  for (const TensorPlan& tp : file.tensors) {
    const LogicalTensor& lt = layer.tensors[tp.tensor_index];
    RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(src, optimizer, lt, tp, read));
    Value tensor = MakeProducedTensor(lt.dtype, tp.shape, std::move(produce));
    const Tensor& like = *lt.shards[0];
    tensor.as_tensor().storage->location = like.storage->location;
    tensor.as_tensor().requires_grad = like.requires_grad;
    tensor.as_tensor().extra_args = like.extra_args;
    Set(job.root, lt.key, std::move(tensor));
  }
  return job;
}

// An mp_rank file; for the FP16_Optimizer format with its optimizer state.
Result<PreparedFile> ModelStatesFile(const LogicalCheckpoint& src, const Plan& plan,
                                     const ModelStatesPlan& ms, bool embedded,
                                     const ExecuteOptions& options, std::atomic<int64_t>* read) {
  PreparedFile job{ms.name, BuildModelStates(src, plan, ms, options.drop_optimizer)};
  if (embedded) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Value> state,
                             BuildOptimizerState(src, *options.optimizer, plan, ms.pp_rank,
                                                 ms.tp_rank, read));
    Set(job.root, "optimizer", std::move(state[0]));
  }
  return job;
}

Status AddShardFiles(const LogicalCheckpoint& src, const Plan& plan, const ModelStatesPlan& ms,
                     const ExecuteOptions& options, std::atomic<int64_t>* read,
                     std::vector<PreparedFile>* files) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<Value> shards,
                           BuildOptimizerState(src, *options.optimizer, plan, ms.pp_rank,
                                               ms.tp_rank, read));
  const int mp = ms.pp_rank * plan.tp + ms.tp_rank;
  for (size_t d = 0; d < shards.size(); ++d) {
    files->push_back({OptimizerFileName(options.optimizer->format().bf16_prefix, static_cast<int>(d), mp),
                     std::move(shards[d])});
  }
  return Status::Ok();
}

// Every file of the plan, with its tensor bytes.
Result<std::vector<PreparedFile>> PrepareFiles(const LogicalCheckpoint& src, const Plan& plan,
                                               const ExecuteOptions& options,
                                               std::atomic<int64_t>* read) {
  // The FP16_Optimizer state lives inside the mp_rank files: no shard files.
  const bool embedded = options.optimizer != nullptr && options.optimizer->format().embedded;
  const bool shards = plan.optimizer && options.optimizer != nullptr && !embedded;
  std::vector<PreparedFile> jobs;
  for (const LayerFilePlan& file : plan.layer_files) {
    RESHARD_ASSIGN_OR_RETURN(PreparedFile job, LayerFile(src, file, options.optimizer, read));
    jobs.push_back(std::move(job));
  }
  for (const ModelStatesPlan& ms : plan.model_states) {
    RESHARD_ASSIGN_OR_RETURN(PreparedFile job, ModelStatesFile(src, plan, ms, embedded, options, read));
    jobs.push_back(std::move(job));
    if (shards) RESHARD_RETURN_IF_ERROR(AddShardFiles(src, plan, ms, options, read, &jobs));
  }
  for (PreparedFile& job : jobs) {
    RESHARD_ASSIGN_OR_RETURN(job.tensor_bytes, TensorBytes(job.root));
  }
  return jobs;
}

// Largest first (names break ties), so that every process orders the same
// way; each job goes to the process with the fewest bytes so far. Returns
// this process's jobs, still largest first, which also balances its threads.
std::vector<PreparedFile> FilesOfRank(std::vector<PreparedFile> jobs, int rank, int ranks) {
  std::sort(jobs.begin(), jobs.end(), [](const PreparedFile& a, const PreparedFile& b) {
    return a.tensor_bytes != b.tensor_bytes ? a.tensor_bytes > b.tensor_bytes : a.name < b.name;
  });
  std::vector<int64_t> load(ranks, 0);
  std::vector<PreparedFile> mine;
  for (PreparedFile& job : jobs) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += job.tensor_bytes + 1;  // + 1: empty files are spread too
    if (r == rank) mine.push_back(std::move(job));
  }
  return mine;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

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
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (std::thread& t : pool) t.join();
  return first_error;
}

// Counts written bytes and files and reports them about once a second.
class Progress {
 public:
  Progress(int64_t files, int64_t bytes, std::function<void(const std::string&)> report)
      : files_(files), bytes_(bytes), report_(std::move(report)) {}

  void AddBytes(int64_t n) {
    bytes_done_ += n;
    MaybeReport(false);
  }
  void FileDone() { MaybeReport(++files_done_ == files_); }

 private:
  using Clock = std::chrono::steady_clock;
  void MaybeReport(bool last) {
    if (!report_) return;
    std::lock_guard<std::mutex> lock(mu_);
    const double t = std::chrono::duration<double>(Clock::now() - start_).count();
    if (!last && t < next_report_) return;
    next_report_ = t + 1.0;
    const double rate = t > 0 ? bytes_done_ / t : 0;
    const double eta = rate > 0 ? (bytes_ - bytes_done_) / rate : 0;
    char line[256];
    std::snprintf(line, sizeof(line), "%lld/%lld files, %s of %s, %s/s, ETA %.0f s",
                  static_cast<long long>(files_done_.load()), static_cast<long long>(files_),
                  HumanBytes(bytes_done_).c_str(), HumanBytes(bytes_).c_str(),
                  HumanBytes(static_cast<int64_t>(rate)).c_str(), eta);
    report_(line);
  }

  const int64_t files_, bytes_;
  std::function<void(const std::string&)> report_;
  std::atomic<int64_t> files_done_{0}, bytes_done_{0};
  std::mutex mu_;
  const Clock::time_point start_ = Clock::now();
  double next_report_ = 1.0;
};

}  // namespace

Execution::Execution(const ExecuteOptions& options) : options_(options) {}
Execution::~Execution() = default;

Result<std::unique_ptr<Execution>> Execution::Prepare(const LogicalCheckpoint& src,
                                                      const Plan& plan,
                                                      const ExecuteOptions& options) {
  std::unique_ptr<Execution> e(new Execution(options));
  RESHARD_ASSIGN_OR_RETURN(std::vector<PreparedFile> all,
                           PrepareFiles(src, plan, options, &e->read_));
  e->files_ = FilesOfRank(std::move(all), options.rank, std::max(1, options.ranks));
  return e;
}

int64_t Execution::files() const { return static_cast<int64_t>(files_.size()); }

int64_t Execution::tensor_bytes() const {
  int64_t total = 0;
  for (const PreparedFile& job : files_) total += job.tensor_bytes;
  return total;
}

Result<ExecuteStats> Execution::Write(const std::string& dir) {
  std::atomic<int64_t> written{0};
  Progress progress(files(), tensor_bytes(), options_.progress);
  const int threads = std::max(1, options_.threads);
  std::vector<std::vector<uint8_t>> buffers(threads);
  auto job = [&](size_t i, int worker) -> Status {
    std::vector<uint8_t>& buffer = buffers[worker];
    buffer.resize(static_cast<size_t>(options_.buffer_bytes));  // allocated when first used
    TorchWriteOptions write;
    write.buffer = &buffer;
    write.written = [&progress](int64_t n) { progress.AddBytes(n); };
    const std::string path = dir + "/" + files_[i].name;
    RESHARD_RETURN_IF_ERROR(WriteTorchFile(path, files_[i].root, write));
    files_[i].root = Value();  // its producers hold source maps; let them go
    written += FileSize(path);
    progress.FileDone();
    return Status::Ok();
  };
  RESHARD_RETURN_IF_ERROR(RunParallel(files_.size(), threads, job));
  return ExecuteStats{written.load(), read_.load()};
}

}  // namespace reshard
