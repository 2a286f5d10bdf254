// reshard::Convert: load, check, plan, execute, commit, update `latest`.
#include <chrono>
#include <filesystem>
#include <optional>

#include "api/common.h"
#include "cluster/cluster.h"
#include "exec/executor.h"
#include "exec/memory_budget.h"
#include "exec/output_folder.h"
#include "logical/drift.h"
#include "formats/deepspeed/zero_shard_reader.h"
#include "formats/deepspeed/state_tensor.h"
#include "reshard/reshard.h"
#include "formats/deepspeed/zero3_checkpoint.h"

namespace reshard {
namespace {

// Loads the optimizer shards to convert them; never drops optimizer state
// without the user saying so (--weights-only).
Status LoadOptimizerState(const LogicalCheckpoint& src, const ConvertOptions& options,
                          std::unique_ptr<SourceOptimizer>* optimizer, ConvertReport* report) {
  const Value* embedded = Find(src.metadata[0], "optimizer");
  const bool in_model_states = embedded != nullptr && !embedded->is_none();
  const size_t shards = src.files.optimizer_files.size();
  if (shards == 0 && !in_model_states) return Status::Ok();
  const std::string what = shards > 0 ? std::to_string(shards) + " optimizer shard files"
                                      : "optimizer state inside its mp_rank files";
  if (options.weights_only) {
    report->notes.push_back(
        "weights only: the " + what + " were not converted. Resume with --no-load-optim "
        "(bigscience Megatron-DeepSpeed; fp32 masters are rebuilt from the weights) or, on "
        "microsoft Megatron-DeepSpeed, which always loads optimizer state, with --finetune");
    return Status::Ok();
  }
  if (in_model_states && !src.pipeline) {
    // Every DP rank holds the whole FP16_Optimizer state; a DP change keeps it as is.
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(*optimizer, SourceOptimizer::Load(src, options.allowed_classes));
  return Status::Ok();
}

// Under `check`, replicated parameters' optimizer state must agree across TP
// ranks too (masters and moments drift like the weights).
Status CheckOptimizerDrift(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                           ReplicatedPolicy policy) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDrift> drifts, MeasureStateDrift(src, opt));
  for (const StateDrift& d : drifts) {
    if (PolicyFor(*d.rule, policy) != ReplicatedPolicy::kCheck) continue;
    return Status::InvalidInput(
        "the optimizer state '" + d.state + "' of replicated parameter " + d.name +
        " differs between TP ranks 0 and " + std::to_string(d.rank) +
        "; choose --replicated average (mean of the copies) or --replicated first (TP rank 0's)");
  }
  return Status::Ok();
}

// Applies the replicated-tensor policy: refuses drift under `check`, reports
// what `average` / `first` will merge.
Status CheckDrift(const LogicalCheckpoint& src, ReplicatedPolicy policy, ConvertReport* report) {
  const std::vector<Drift> drifts = MeasureDrift(src);
  int checked = 0, merged = 0;
  const Drift* worst_checked = nullptr;
  for (const Drift& d : drifts) {
    const ParamRule& rule = *src.layers[d.layer_index].tensors[d.tensor_index].rule;
    if (PolicyFor(rule, policy) == ReplicatedPolicy::kCheck) {
      if (worst_checked == nullptr) worst_checked = &d;
      ++checked;
    } else {
      ++merged;
    }
  }
  if (checked > 0) {
    return Status::InvalidInput(
        std::to_string(checked) + " replicated tensor(s) differ across TP ranks (largest: " +
        DescribeDrift(src, *worst_checked) +
        "); choose --replicated average (mean of the copies) or --replicated first (TP rank 0's "
        "copy), or see them all with `reshard lint`");
  }
  if (merged > 0) {
    report->notes.push_back("replicated: " + std::to_string(merged) +
                            " tensor(s) differed across TP ranks and were merged by their policy "
                            "(largest: " + DescribeDrift(src, drifts.front()) + ")");
  }
  return Status::Ok();
}

// Checks the output folder; writing `latest` into the input's root would
// change which checkpoint the input root names, which is modifying the input.
Result<OutputFolder> CheckOutput(const std::string& input, const CheckpointFiles& files,
                                 const std::string& output, const ConvertOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(OutputFolder out,
                           OutputFolder::Check(output, {input, files.tag_dir}, options.overwrite));
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path parent = fs::path(out.path()).parent_path();
  if (options.update_latest && fs::equivalent(parent, files.root_dir, ec)) {
    return Status::InvalidInput("the output folder " + out.path() + " is beside the input in " +
                                parent.string() + ", whose 'latest' it would replace; choose a "
                                "folder elsewhere or pass --no-update-latest");
  }
  return out;
}

// Moves the finished folder into place, then `latest` (and
// latest_checkpointed_iteration.txt where the source root has one).
Status Publish(OutputFolder* out, const CheckpointFiles& source, int64_t iteration,
               bool update_latest) {
  RESHARD_RETURN_IF_ERROR(out->Commit());
  if (!update_latest) return Status::Ok();
  namespace fs = std::filesystem;
  const fs::path out_path(out->path());
  std::optional<int64_t> iteration_file;
  std::error_code ec;
  if (fs::exists(fs::path(source.root_dir) / "latest_checkpointed_iteration.txt", ec)) {
    iteration_file = iteration;
  }
  return UpdateLatest(out_path.parent_path().string(), out_path.filename().string(), iteration_file);
}

PlanOptions ToPlanOptions(const ConvertOptions& o) {
  PlanOptions p;
  p.tp = o.target_tp;
  p.pp = o.target_pp;
  p.dp = o.target_dp;
  p.layers_per_stage = o.layers_per_stage;
  p.replicated = o.replicated;
  p.vocab_size = o.vocab_size;
  p.vocab_pad_value = o.vocab_pad_value;
  return p;
}

// Times the phases of a conversion.
class PhaseClock {
 public:
  explicit PhaseClock(ConvertReport* report) : report_(report) {}
  // Ends the current phase under `name`.
  void End(const std::string& name) {
    const auto now = std::chrono::steady_clock::now();
    report_->phases.emplace_back(name, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  double Total() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  ConvertReport* report_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

int64_t FolderBytes(const std::string& dir) {
  namespace fs = std::filesystem;
  int64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec)) total += static_cast<int64_t>(entry.file_size(ec));
  }
  return total;
}

// Every process of a cluster passes its status and all get the first
// failure; alone, a process keeps its own.
Status AllOk(Cluster* cluster, const Status& mine) {
  return cluster != nullptr ? cluster->AllOk(mine) : mine;
}

bool IsRoot(const Cluster* cluster) { return cluster == nullptr || cluster->rank() == 0; }

// The staging folder: made by the first process, announced to the others.
Result<std::string> BeginOutput(OutputFolder* out, Cluster* cluster) {
  Status begun = IsRoot(cluster) ? out->Begin() : Status::Ok();
  RESHARD_RETURN_IF_ERROR(AllOk(cluster, begun));
  if (cluster == nullptr) return out->staging_dir();
  return cluster->Broadcast(out->staging_dir());
}

// Writes this process's share of the plan into the staging folder; the first
// process moves the folder into place and `latest` once every process is done.
Status Execute(const LogicalCheckpoint& src, Execution* execution, OutputFolder* out,
               const ConvertOptions& options, PhaseClock* clock, ConvertReport* report) {
  Cluster* cluster = options.cluster;
  RESHARD_ASSIGN_OR_RETURN(std::string staging, BeginOutput(out, cluster));
  Result<ExecuteStats> stats = execution->Write(staging);
  RESHARD_RETURN_IF_ERROR(AllOk(cluster, stats.status()));
  clock->End("write");
  report->bytes_written = stats->bytes_written;
  report->bytes_read = stats->bytes_read;
  if (!IsRoot(cluster)) return Status::Ok();
  RESHARD_RETURN_IF_ERROR(Publish(out, src.files, src.iteration, options.update_latest));
  clock->End("commit");
  return Status::Ok();
}

// ZeRO-3 checkpoints have no layer files: their model layout stays, DP changes.
Result<ConvertReport> ConvertZero3(const CheckpointFiles& files, const std::string& input,
                                   const std::string& output, const ConvertOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<Zero3Checkpoint> src,
                           Zero3Checkpoint::Load(files, options.allowed_classes));
  if (options.target_tp != src->mp() || options.target_pp != 1 || !options.layers_per_stage.empty()) {
    return Status::InvalidInput("a ZeRO-3 checkpoint keeps its model layout; pass --tp " +
                                std::to_string(src->mp()) + " --pp 1 and choose the new --dp");
  }
  if (options.weights_only) {
    return Status::InvalidInput("a ZeRO-3 checkpoint keeps its weights in the optimizer shards "
                                "(fp32 masters); --weights-only does not apply");
  }
  const int dp = options.target_dp > 0 ? options.target_dp : src->dp();
  ConvertReport report;
  report.plan = src->Summary() + "\ntarget: DP " + std::to_string(dp) + "; " +
                std::to_string(2 * dp * src->mp()) + " files (model states and optimizer shards per DP rank)\n";
  RESHARD_ASSIGN_OR_RETURN(OutputFolder out, CheckOutput(input, files, output, options));
  if (options.dry_run) return report;
  RESHARD_RETURN_IF_ERROR(out.Begin());
  const bool bf16 = !files.optimizer_files.empty() && files.optimizer_files[0].bf16;
  RESHARD_ASSIGN_OR_RETURN(report.files, src->Write(dp, out.staging_dir(), bf16));
  RESHARD_RETURN_IF_ERROR(Publish(&out, files, src->iteration(), options.update_latest));
  return report;
}

// Threads and buffers from the memory budget, and this process's share.
Result<ExecuteOptions> ExecutionOptions(const ConvertOptions& options,
                                        const SourceOptimizer* optimizer, ConvertReport* report) {
  RESHARD_ASSIGN_OR_RETURN(MemoryBudget memory,
                           MemoryBudget::Plan(options.max_memory, ThreadCount(options.threads)));
  report->memory_budget = memory.budget;
  report->memory_estimate = memory.Estimate();
  report->buffer_bytes = memory.buffer_bytes;
  report->threads = memory.threads;
  ExecuteOptions exec;
  exec.threads = memory.threads;
  exec.buffer_bytes = memory.buffer_bytes;
  exec.drop_optimizer = options.weights_only;
  exec.progress = options.progress;
  exec.optimizer = optimizer;
  if (options.cluster != nullptr) {
    exec.rank = options.cluster->rank();
    exec.ranks = options.cluster->size();
  }
  return exec;
}

// Everything before writing: load, check, plan, size the buffers. On error,
// processes of a cluster still meet (see Execute), so it returns a status.
struct Prepared {
  std::unique_ptr<LogicalCheckpoint> src;
  std::unique_ptr<SourceOptimizer> optimizer;
  Plan plan;
  std::unique_ptr<Execution> execution;
};

Status Prepare(CheckpointFiles files, const std::string& input, const std::string& output,
               const ConvertOptions& options, PhaseClock* clock, Prepared* p,
               std::optional<OutputFolder>* out, ConvertReport* report) {
  report->checkpoint_bytes = FolderBytes(files.tag_dir);
  RESHARD_ASSIGN_OR_RETURN(p->src, LoadForCommand(std::move(files), options));
  const LogicalCheckpoint& src = *p->src;
  RESHARD_RETURN_IF_ERROR(src.FirstError());
  RESHARD_RETURN_IF_ERROR(LoadOptimizerState(src, options, &p->optimizer, report));
  clock->End("load");
  if (options.dry_run) {
    // Planning reads metadata only, so it takes seconds at any size.
    report->notes.push_back("dry run: replicated tensors were not compared across TP ranks; "
                            "`reshard lint` does, and convert refuses drift it is not told to merge");
  } else {
    RESHARD_RETURN_IF_ERROR(CheckDrift(src, options.replicated, report));
    if (p->optimizer && src.pipeline) {
      RESHARD_RETURN_IF_ERROR(CheckOptimizerDrift(src, *p->optimizer, options.replicated));
    }
    clock->End("check");
  }
  PlanOptions plan_options = ToPlanOptions(options);
  plan_options.optimizer = p->optimizer != nullptr && !p->optimizer->format().embedded;
  RESHARD_ASSIGN_OR_RETURN(p->plan, MakePlan(src, plan_options));
  report->plan = p->plan.ToString(src, options.dry_run);
  report->notes.insert(report->notes.end(), p->plan.notes.begin(), p->plan.notes.end());
  if (p->optimizer != nullptr && p->optimizer->format().embedded) {
    report->notes.push_back("optimizer: the FP16_Optimizer state inside the mp_rank files is "
                            "reshaped with the weights (its groups follow DeepSpeed's current "
                            "stage partition)");
  }
  RESHARD_ASSIGN_OR_RETURN(OutputFolder folder, CheckOutput(input, src.files, output, options));
  out->emplace(std::move(folder));
  RESHARD_ASSIGN_OR_RETURN(ExecuteOptions exec,
                           ExecutionOptions(options, p->optimizer.get(), report));
  RESHARD_ASSIGN_OR_RETURN(p->execution, Execution::Prepare(src, p->plan, exec));
  report->files = p->execution->files();
  report->tensor_bytes = p->execution->tensor_bytes();
  clock->End("plan");
  return Status::Ok();
}

}  // namespace

Result<ConvertReport> Convert(const std::string& input, const std::string& output,
                              const ConvertOptions& options) {
  if (options.target_tp < 1 || options.target_pp < 1) {
    return Status::InvalidInput("convert needs the target layout: --tp N and --pp N (both >= 1)");
  }
  ConvertReport report;
  PhaseClock clock(&report);
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(input));
  if (files.IsZero3()) {
    if (options.cluster != nullptr && options.cluster->size() > 1) {
      return Status::Unsupported("a ZeRO-3 checkpoint is converted by one process; run reshard "
                                 "without mpirun/srun");
    }
    Result<ConvertReport> zero3 = ConvertZero3(files, input, output, options);
    if (zero3.ok()) zero3->seconds = clock.Total();
    return zero3;
  }
  Prepared p;
  std::optional<OutputFolder> out;
  Status ready = Prepare(std::move(files), input, output, options, &clock, &p, &out, &report);
  if (options.dry_run) {
    RESHARD_RETURN_IF_ERROR(ready);
  } else {
    RESHARD_RETURN_IF_ERROR(AllOk(options.cluster, ready));
    RESHARD_RETURN_IF_ERROR(
        Execute(*p.src, p.execution.get(), &*out, options, &clock, &report));
    report.peak_memory = PeakResidentBytes();
  }
  report.seconds = clock.Total();
  return report;
}

}  // namespace reshard
