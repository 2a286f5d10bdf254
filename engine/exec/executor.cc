#include "exec/executor.h"

#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

#include "exec/model_states.h"
#include "format/torch_file.h"
#include "optim/optimizer_writer.h"
#include "optim/state_tensor.h"

namespace reshard {
namespace {

// A new contiguous tensor owning `bytes`, with the source tensor's flags.
Value NewTensor(const Tensor& like, const std::vector<int64_t>& shape,
                std::shared_ptr<std::vector<uint8_t>> bytes) {
  Value v = MakeOwnedTensor(like.storage->dtype, shape, std::move(bytes), like.storage->location);
  v.as_tensor().requires_grad = like.requires_grad;
  v.as_tensor().extra_args = like.extra_args;
  return v;
}

// Builds and writes one layer file; returns the source bytes read.
Result<int64_t> WriteLayerFile(const LogicalCheckpoint& src, const LayerFilePlan& file,
                               const SourceOptimizer* optimizer, const std::string& dir) {
  const LogicalLayer& layer = src.layers[file.layer_index];
  Value root = layer.roots[0];  // keeps the source's container type, key order and extras
  int64_t read = 0;
  for (const TensorPlan& tp : file.tensors) {
    const LogicalTensor& lt = layer.tensors[tp.tensor_index];
    auto bytes = std::make_shared<std::vector<uint8_t>>();
    RESHARD_ASSIGN_OR_RETURN(int64_t r, MaterializeWeight(src, optimizer, lt, tp, bytes.get()));
    read += r;
    Set(root, lt.key, NewTensor(*lt.shards[0], tp.shape, std::move(bytes)));
  }
  RESHARD_RETURN_IF_ERROR(WriteTorchFile(dir + "/" + file.name, root));
  return read;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

// Runs jobs 0..n-1 on `threads` workers; stops handing out work after the
// first failure and returns it.
Status RunParallel(size_t n, int threads, const std::function<Status(size_t)>& job) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first_error;
  auto worker = [&] {
    for (size_t i = next++; i < n && !failed; i = next++) {
      Status st = job(i);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true)) first_error = st;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return first_error;
}

// What one job wrote, for the progress line and the totals.
struct JobResult {
  std::string name;
  int64_t read = 0;
  int64_t written = 0;
};

Result<JobResult> LayerJob(const LogicalCheckpoint& src, const LayerFilePlan& file,
                           const ExecuteOptions& options, const std::string& dir) {
  JobResult r{file.name};
  RESHARD_ASSIGN_OR_RETURN(r.read, WriteLayerFile(src, file, options.optimizer, dir));
  r.written = FileSize(dir + "/" + file.name);
  return r;
}

// An mp_rank file; for the FP16_Optimizer format with its optimizer state.
Result<JobResult> ModelStatesJob(const LogicalCheckpoint& src, const Plan& plan,
                                 const ModelStatesPlan& ms, bool embedded,
                                 const ExecuteOptions& options, const std::string& dir) {
  JobResult r{ms.name};
  Value root = BuildModelStates(src, plan, ms, options.drop_optimizer);
  if (embedded) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Value> state,
                             BuildOptimizerState(src, *options.optimizer, plan, ms.pp_rank,
                                                 ms.tp_rank, &r.read));
    Set(root, "optimizer", std::move(state[0]));
  }
  RESHARD_RETURN_IF_ERROR(WriteTorchFile(dir + "/" + ms.name, root));
  r.written = FileSize(dir + "/" + ms.name);
  return r;
}

// The optimizer shards of every target DP rank of one (pipeline, tensor) rank.
Result<JobResult> ShardJob(const LogicalCheckpoint& src, const Plan& plan, const ModelStatesPlan& ms,
                           const ExecuteOptions& options, const std::string& dir) {
  const int mp = ms.pp_rank * plan.tp + ms.tp_rank;
  JobResult r{"optimizer shards of " + ModelStatesName(mp)};
  RESHARD_ASSIGN_OR_RETURN(r.read, WriteOptimizerShards(src, *options.optimizer, plan, ms.pp_rank,
                                                        ms.tp_rank, dir));
  for (int d = 0; d < plan.dp; ++d) {
    r.written += FileSize(dir + "/" + OptimizerFileName(options.optimizer->format(), d, mp));
  }
  return r;
}

}  // namespace

Result<ExecuteStats> ExecutePlan(const LogicalCheckpoint& src, const Plan& plan,
                                 const std::string& dir, const ExecuteOptions& options) {
  const size_t layer_jobs = plan.layer_files.size();
  const size_t states_jobs = plan.model_states.size();
  // The FP16_Optimizer state lives inside the mp_rank files: no shard jobs.
  const bool embedded = options.optimizer != nullptr && options.optimizer->format().embedded;
  const bool shards = plan.optimizer && options.optimizer != nullptr && !embedded;
  const size_t total = layer_jobs + states_jobs + (shards ? states_jobs : 0);
  std::atomic<int64_t> read{0}, written{0}, done{0};
  std::mutex progress_mu;
  auto job = [&](size_t i) -> Status {
    Result<JobResult> r =
        i < layer_jobs ? LayerJob(src, plan.layer_files[i], options, dir)
        : i < layer_jobs + states_jobs
            ? ModelStatesJob(src, plan, plan.model_states[i - layer_jobs], embedded, options, dir)
            : ShardJob(src, plan, plan.model_states[i - layer_jobs - states_jobs], options, dir);
    if (!r.ok()) return r.status();
    read += r->read;
    written += r->written;
    const int64_t n = ++done;
    if (options.progress) {
      std::lock_guard<std::mutex> lock(progress_mu);
      char line[256];
      std::snprintf(line, sizeof(line), "[%lld/%zu] %s", static_cast<long long>(n), total,
                    r->name.c_str());
      options.progress(line);
    }
    return Status::Ok();
  };
  RESHARD_RETURN_IF_ERROR(RunParallel(total, std::max(1, options.threads), job));
  const size_t files = layer_jobs + states_jobs + (shards ? states_jobs * plan.dp : 0);
  return ExecuteStats{static_cast<int64_t>(files), written.load(), read.load()};
}

}  // namespace reshard
