// MoePlan: a DeepSpeed MoE checkpoint at another expert-parallel and
// data-parallel size, as plain data, and the TargetPlan that writes it.
//
// TP and the pipeline stages are kept, so every mp_rank file keeps its
// tensors (written compact: DeepSpeed saves them as views into the
// optimizer's flat buffers) with dp_world_size rewritten, and every expert
// file (named by global expert id) is carried. The optimizer is re-cut:
// the non-expert groups over the target DP, and per target EP rank r the
// experts r * E/EP .. (r+1) * E/EP - 1 of every MoE layer, under their new
// local ids, laid out in the source's order and partitioned over the target
// expert-DP (DP / EP). One expp_rank file per target EP rank. The module's
// `_metadata` lists the target EP rank 0's expert modules.
#pragma once

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "formats/deepspeed/checkpoint_files.h"
#include "formats/deepspeed/moe_layout.h"
#include "formats/deepspeed/moe_optimizer.h"
#include "formats/deepspeed/pipeline_plan.h"
#include "formats/format.h"

namespace reshard {

struct MoeStagePlan {
  int mp = 0;  // the mp rank, source and target
  // Per target EP rank (empty: weights only).
  std::vector<OptimizerStagePlan> optimizer;
};

struct MoePlan {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int source_ep = 1;
  std::vector<MoeStagePlan> stages;  // per mp rank
  std::vector<std::string> notes;
  // `--dry-run`'s listing; `detail` adds every fragment of every partition.
  std::string ToString(bool detail) const;
};

// Plans `src` (read by the MoE reader: `layout`, `files`) at target EP `ep`
// and DP `dp`; `opt` null: weights only.
Result<MoePlan> MakeMoePlan(const LogicalCheckpoint& src, const MoeLayout& layout, const MoeOptimizer* opt,
                            int ep, int dp, ReplicatedPolicy replicated);

// The plan as the TargetPlan convert runs; the arguments must outlive it.
class MoeTargetPlan : public TargetPlan {
 public:
  MoeTargetPlan(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeLayout& layout,
                const MoeOptimizer* opt, std::set<std::string> allowed_classes, MoePlan plan)
      : src_(src), files_(files), layout_(layout), opt_(opt), allowed_classes_(std::move(allowed_classes)),
        plan_(std::move(plan)) {}
  std::string ToString(bool detail) const override { return plan_.ToString(detail); }
  Result<std::vector<Job>> Jobs(std::atomic<int64_t>* read) const override;

 private:
  Status AddStageJobs(const MoeStagePlan& stage, std::atomic<int64_t>* read, std::vector<Job>* jobs) const;

  const LogicalCheckpoint& src_;
  const CheckpointFiles& files_;
  const MoeLayout& layout_;
  const MoeOptimizer* opt_;
  std::set<std::string> allowed_classes_;
  MoePlan plan_;
};

}  // namespace reshard
