// reshard::Convert: load, check, plan, execute, commit, update `latest`.
#include <chrono>
#include <filesystem>

#include "api/common.h"
#include "exec/executor.h"
#include "exec/output_folder.h"
#include "logical/drift.h"
#include "optim/source_optimizer.h"
#include "optim/state_tensor.h"
#include "reshard/reshard.h"
#include "zero3/zero3_checkpoint.h"

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

// Writes the plan into `output` and moves `latest`.
Status Execute(const LogicalCheckpoint& src, const Plan& plan, const SourceOptimizer* optimizer,
               OutputFolder* out, const ConvertOptions& options, ConvertReport* report) {
  RESHARD_RETURN_IF_ERROR(out->Begin());
  ExecuteOptions exec;
  exec.threads = ThreadCount(options.threads);
  exec.drop_optimizer = options.weights_only;
  exec.progress = options.progress;
  exec.optimizer = optimizer;
  RESHARD_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(src, plan, out->staging_dir(), exec));
  report->files_written = stats.files;
  report->bytes_written = stats.bytes_written;
  report->bytes_read = stats.bytes_read;
  return Publish(out, src.files, src.iteration, options.update_latest);
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
  RESHARD_ASSIGN_OR_RETURN(report.files_written, src->Write(dp, out.staging_dir(), bf16));
  RESHARD_RETURN_IF_ERROR(Publish(&out, files, src->iteration(), options.update_latest));
  return report;
}

}  // namespace

Result<ConvertReport> Convert(const std::string& input, const std::string& output,
                              const ConvertOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (options.target_tp < 1 || options.target_pp < 1) {
    return Status::InvalidInput("convert needs the target layout: --tp N and --pp N (both >= 1)");
  }
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(input));
  if (files.IsZero3()) {
    Result<ConvertReport> report = ConvertZero3(files, input, output, options);
    if (report.ok()) report->seconds = elapsed();
    return report;
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> src, LoadForCommand(std::move(files), options));
  RESHARD_RETURN_IF_ERROR(src->FirstError());
  ConvertReport report;
  std::unique_ptr<SourceOptimizer> optimizer;
  RESHARD_RETURN_IF_ERROR(LoadOptimizerState(*src, options, &optimizer, &report));
  RESHARD_RETURN_IF_ERROR(CheckDrift(*src, options.replicated, &report));
  if (optimizer && src->pipeline) {
    RESHARD_RETURN_IF_ERROR(CheckOptimizerDrift(*src, *optimizer, options.replicated));
  }
  PlanOptions plan_options = ToPlanOptions(options);
  plan_options.optimizer = optimizer != nullptr && !optimizer->format().embedded;
  RESHARD_ASSIGN_OR_RETURN(Plan plan, MakePlan(*src, plan_options));
  report.plan = plan.ToString(*src, options.dry_run);
  report.notes.insert(report.notes.end(), plan.notes.begin(), plan.notes.end());
  if (optimizer != nullptr && optimizer->format().embedded) {
    report.notes.push_back("optimizer: the FP16_Optimizer state inside the mp_rank files is "
                           "reshaped with the weights (its groups follow DeepSpeed's current "
                           "stage partition)");
  }
  RESHARD_ASSIGN_OR_RETURN(OutputFolder out, CheckOutput(input, src->files, output, options));
  if (!options.dry_run) {
    RESHARD_RETURN_IF_ERROR(Execute(*src, plan, optimizer.get(), &out, options, &report));
  }
  report.seconds = elapsed();
  return report;
}

}  // namespace reshard
