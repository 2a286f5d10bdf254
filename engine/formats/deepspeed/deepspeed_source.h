// The three kinds of DeepSpeed checkpoint as SourceCheckpoints.
//
//   pipeline       Megatron-DeepSpeed / PipelineModule: layer files per spec
//                  and TP rank, rules describe every tensor; TP, PP and DP change.
//   non-pipeline   the whole model in each mp_rank file's `module`; DP changes.
//   ZeRO-3         per-DP-rank model states and per-parameter partitions; DP changes.
//   MoE            DeepSpeed's MoE save: the model in the mp_rank files' `module`,
//                  experts in files of their own; read, not yet converted.
//
// OpenDeepSpeedCheckpoint tells them apart once, from the file names and
// mp_rank_00; nothing above this folder asks which kind it holds.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/universal/universal_reader.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "formats/format.h"
#include "logical/imported_model.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

Result<std::unique_ptr<SourceCheckpoint>> OpenDeepSpeedCheckpoint(CheckpointFiles files,
                                                                  const CommonOptions& options);

// Each kind's constructor (deepspeed_pipeline.cc, deepspeed_nonpipeline.cc, deepspeed_zero3.cc).
std::unique_ptr<SourceCheckpoint> MakePipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                     const CommonOptions& options);
// A universal checkpoint read by universal_reader.h.
std::unique_ptr<SourceCheckpoint> MakeUniversalSource(UniversalCheckpoint universal,
                                                      const CommonOptions& options);
// A model another format read (logical/imported_model.h) laid out in
// DeepSpeed's files: what the deepspeed and universal targets plan it as. Its
// metadata becomes a fresh run's mp_rank metadata (FreshRunModelStates), and
// its optimizer state the shards optimizer/imported_state.h chooses.
std::unique_ptr<SourceCheckpoint> MakeImportedSource(ImportedModel imported, const CommonOptions& options);
std::unique_ptr<SourceCheckpoint> MakeNonPipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                        const CommonOptions& options);
Result<std::unique_ptr<SourceCheckpoint>> OpenZero3Source(CheckpointFiles files,
                                                          const CommonOptions& options);
// deepspeed_moe.cc
Result<std::unique_ptr<SourceCheckpoint>> OpenMoeSource(CheckpointFiles files, const CommonOptions& options);

// How DeepSpeed names a converted checkpoint beside it, unless
// `update_latest` is false: `latest` (with latest_checkpointed_iteration.txt
// where the source root has one, as Megatron writes it) and the scripts
// DeepSpeed copies into every root. `latest` must not be written into the
// source's own root. A source opened through its root gives a root: the
// tag folder inside the output path, `latest` beside it.
Publication NativePublication(const CheckpointFiles& files, int64_t iteration, bool update_latest);

// A DeepSpeedPlan as the OutputPlan convert prints and writes, published as
// NativePublication says; `src` and `opt` (may be null) must outlive it.
Result<OutputPlan> NativeOutput(const LogicalCheckpoint& src, const SourceOptimizer* opt, const DeepSpeedPlan& plan,
                                const CheckpointFiles& files, int64_t iteration, bool update_latest);

// What the pipeline and non-pipeline kinds share: the model read from the
// tag folder, and its optimizer state, read once, when a command first
// needs it.
class DeepSpeedModelSource : public SourceCheckpoint {
 public:
  DeepSpeedModelSource(std::unique_ptr<DeepSpeedModel> model, const CommonOptions& options)
      : model_(std::move(model)), allowed_classes_(options.allowed_classes), weights_only_(options.weights_only) {}
  // A universal checkpoint, whose optimizer state was read with the model.
  DeepSpeedModelSource(UniversalCheckpoint universal, const CommonOptions& options)
      : DeepSpeedModelSource(std::move(universal.model), std::move(universal.optimizer), universal.optimizer_status,
                             options) {}
  // A model whose optimizer state was read with it: `optimizer`, or why
  // not in `optimizer_status` (neither: it has none).
  DeepSpeedModelSource(std::unique_ptr<DeepSpeedModel> model, std::unique_ptr<SourceOptimizer> optimizer,
                       Status optimizer_status, const CommonOptions& options)
      : model_(std::move(model)), allowed_classes_(options.allowed_classes), weights_only_(options.weights_only),
        optimizer_read_(optimizer != nullptr || !optimizer_status.ok()), optimizer_(std::move(optimizer)),
        optimizer_status_(std::move(optimizer_status)) {}

  // The metadata, the layer files' tensors and the problems found reading them.
  std::string Describe() const override;
  std::vector<MissingValue> MissingValues(std::optional<int> repad_tp,
                                          std::optional<int64_t> vocab_size) const override;

 protected:
  // Sets info_ from the model read, with the kind's name and summary;
  // `vocab`: the checkpoint's vocabulary tensors are described by its rules.
  void SetInfo(std::string kind, std::string summary, bool vocab);
  // Replicas that differ, for verify (the kinds whose rules name replicas).
  std::vector<std::string> DriftNotes() const;
  // What a dry run says it did not check.
  static const char kDryRunNote[];

  const LogicalCheckpoint& ckpt() const { return model_->logical; }
  size_t shard_files() const { return model_->files.optimizer_files.size(); }
  const CheckpointFiles& files() const { return model_->files; }
  // Shard files, optimizer state inside the mp_rank files, or a universal checkpoint.
  bool HasOptimizerState() const;
  // "4 optimizer shard files", for the weights-only note.
  std::string OptimizerWhat() const;
  Result<const SourceOptimizer*> Optimizer() const;
  // Opened for its weights only (CommonOptions::weights_only): the optimizer
  // state is neither read nor carried.
  bool weights_only() const { return weights_only_; }
  // The optimizer state the commands carry: null when there is none or the
  // checkpoint was opened weights-only.
  Result<const SourceOptimizer*> CarriedOptimizer() const;

  std::unique_ptr<DeepSpeedModel> model_;

 private:
  std::set<std::string> allowed_classes_;
  const bool weights_only_ = false;
  const bool optimizer_read_ = false;  // with the model, not from shard files
  mutable std::once_flag optimizer_once_;
  mutable std::unique_ptr<SourceOptimizer> optimizer_;
  mutable Status optimizer_status_;
};

// "optimizer exp_avg <param>", with " on mp_rank_MM" when there are several
// model-parallel ranks: how verify names a state compared rank by rank.
std::string StateName(const std::string& state, const std::string& param, int mp, int mp_ranks);

// Every weight of `ckpt` whole, TP replicas merged by `replicated`; an
// average of replicas comes from the averaged fp32 masters of `masters`
// (may be null). Producers add the bytes they read to *read.
Result<std::vector<FullTensor>> WeightTensors(const LogicalCheckpoint& ckpt, const SourceOptimizer* masters,
                                              ReplicatedPolicy replicated, std::atomic<int64_t>* read);

// The metadata lines of `inspect`.
std::string MetadataLines(const LogicalCheckpoint& ckpt);
// The tensor lines of `inspect`: every layer's tensors with their rules and
// names, then the problems found.
std::string TensorLines(const LogicalCheckpoint& ckpt);

}  // namespace reshard
