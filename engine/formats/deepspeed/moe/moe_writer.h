// MoeTargetPlan: writes a MoePlan (moe_plan.h). Per target stage: its
// mp_rank file (the source metadata with the stage's module, its tensors
// copied as saved or cut for the target TP, its `_metadata` listing the
// stage's modules), its expert files (the source's, cut for the target TP
// when TP changes), its optimizer shards and one expp_rank file per target
// EP rank.
#pragma once

#include <atomic>
#include <set>
#include <string>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/moe/moe_optimizer.h"
#include "formats/deepspeed/moe/moe_plan.h"
#include "formats/format.h"

namespace reshard {

// The plan as the TargetPlan convert runs; the arguments must outlive it.
class MoeTargetPlan : public TargetPlan {
 public:
  MoeTargetPlan(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeOptimizer* opt,
                std::set<std::string> allowed_classes, MoePlan plan)
      : src_(src), files_(files), opt_(opt), allowed_classes_(std::move(allowed_classes)), plan_(std::move(plan)) {}
  std::string ToString(bool detail) const override { return plan_.ToString(detail); }
  Result<std::vector<Job>> Jobs(std::atomic<int64_t>* read) const override;

 private:
  Status AddStageJobs(const MoeStagePlan& stage, const TensorIndex& index, std::atomic<int64_t>* read,
                      std::vector<Job>* jobs) const;
  // The stage's mp_rank file: the source metadata with the stage's module.
  Result<Value> ModelStates(const MoeStagePlan& stage, std::atomic<int64_t>* read) const;
  // An expert file of the stage: the source's, its tensors cut for the
  // stage's TP rank when TP changes (whole experts are taken from TP rank 0's
  // or merged by the replicated policy; expert-TP ones cut by their rules).
  Result<Value> ExpertFile(const MoeStagePlan& stage, const MoeExpertFilePlan& file, const TensorIndex& index,
                           std::atomic<int64_t>* read) const;
  // Tensor src.layers[layer].tensors[tensor] at the stage's TP rank, cut
  // from every source TP rank's, stored as `like` (its saved tensor) was.
  Result<Value> CutTensor(const MoeStagePlan& stage, int layer, int tensor, const Value& like,
                          std::atomic<int64_t>* read) const;

  const LogicalCheckpoint& src_;
  const CheckpointFiles& files_;
  const MoeOptimizer* opt_;
  std::set<std::string> allowed_classes_;
  MoePlan plan_;
};

}  // namespace reshard
