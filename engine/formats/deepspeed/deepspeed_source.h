// The three kinds of DeepSpeed checkpoint as SourceCheckpoints.
//
//   pipeline       Megatron-DeepSpeed / PipelineModule: layer files per spec
//                  and TP rank, rules describe every tensor; TP, PP and DP change.
//   non-pipeline   the whole model in each mp_rank file's `module`; DP changes.
//   ZeRO-3         per-DP-rank model states and per-parameter partitions; DP changes.
//
// OpenDeepSpeedCheckpoint tells them apart once, from the file names and
// mp_rank_00; nothing above this folder asks which kind it holds.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "formats/deepspeed/checkpoint_files.h"
#include "formats/deepspeed/pipeline_plan.h"
#include "formats/deepspeed/pipeline_reader.h"
#include "formats/deepspeed/zero_shard_reader.h"
#include "formats/format.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

Result<std::unique_ptr<SourceCheckpoint>> OpenDeepSpeedCheckpoint(CheckpointFiles files,
                                                                  const CommonOptions& options);

// Each kind's constructor (deepspeed_pipeline.cc, deepspeed_nonpipeline.cc, deepspeed_zero3.cc).
std::unique_ptr<SourceCheckpoint> MakePipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                     const CommonOptions& options);
std::unique_ptr<SourceCheckpoint> MakeNonPipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                        const CommonOptions& options);
Result<std::unique_ptr<SourceCheckpoint>> OpenZero3Source(CheckpointFiles files,
                                                          const CommonOptions& options);

// A DeepSpeedPlan as the TargetPlan convert prints and runs; `src` and `opt`
// (may be null) must outlive it.
class DeepSpeedTargetPlan : public TargetPlan {
 public:
  DeepSpeedTargetPlan(const LogicalCheckpoint& src, const SourceOptimizer* opt, DeepSpeedPlan plan)
      : src_(src), opt_(opt), plan_(std::move(plan)) {}
  std::string ToString(bool detail) const override;
  Result<std::vector<Job>> Jobs(std::atomic<int64_t>* read) const override;

 private:
  const LogicalCheckpoint& src_;
  const SourceOptimizer* opt_;
  DeepSpeedPlan plan_;
};

// A model's optimizer shards (or mp_rank optimizer state), read once, when a
// command first needs them; `model` must outlive it.
class LazyOptimizer {
 public:
  LazyOptimizer(const DeepSpeedModel* model, std::set<std::string> allowed_classes)
      : model_(model), allowed_classes_(std::move(allowed_classes)) {}
  Result<const SourceOptimizer*> Get() const;

 private:
  const DeepSpeedModel* model_;
  std::set<std::string> allowed_classes_;
  mutable std::once_flag once_;
  mutable std::unique_ptr<SourceOptimizer> optimizer_;
  mutable Status status_;
};

// "optimizer exp_avg <param>", with " on mp_rank_MM" when there are several
// model-parallel ranks: how verify names a state compared rank by rank.
std::string StateName(const std::string& state, const std::string& param, int mp, int mp_ranks);

// Lines shared by the kinds' `inspect` output.
std::string MetadataLines(const LogicalCheckpoint& ckpt);
std::string LayerLines(const LogicalCheckpoint& ckpt);

}  // namespace reshard
