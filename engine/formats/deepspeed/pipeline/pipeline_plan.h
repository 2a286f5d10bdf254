// DeepSpeedPlan: everything a conversion to a DeepSpeed tag folder writes, as
// plain data.
//
// For every target layer file, every tensor's TensorPlan; for every target
// mp_rank file, the source rank whose metadata it rewrites and the stage's
// parameter names and shapes; for every target (pipeline, tensor) rank's
// optimizer state, the flat groups (slots, alignment, DP partitions, hence
// fragments) and each slot's tensor plans. Making a plan reads no tensor
// data; pipeline_writer turns it into the OutputPlan that `convert --dry-run`
// prints and the writer writes.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/deepspeed/model/flat_group.h"
#include "formats/format.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "logical/logical_checkpoint.h"
#include "plan/tensor_plan.h"

namespace reshard {

// One target layer_NN-model_TT-model_states.pt.
struct LayerFilePlan {
  std::string name;
  int layer_index = 0;  // into LogicalCheckpoint::layers
  int tp_rank = 0;
  std::vector<TensorPlan> tensors;  // in the source file's key order
};

// One target mp_rank_XX_model_states.pt.
struct ModelStatesPlan {
  std::string name;
  int pp_rank = 0, tp_rank = 0;
  int source_mp = 0;  // source mp_rank file whose metadata and RNG state are copied
  std::vector<std::vector<ParamShape>> param_shapes;  // per optimizer group
  std::vector<std::string> buffer_names;
};

// One parameter in a target flat group: its optimizer state is the source
// parameter's, re-sharded like the weight.
struct OptimizerSlotPlan {
  std::string source_param;  // the parameter's name in the source shards
  TensorPlan master;  // new vocabulary rows take the weights' fill ...
  TensorPlan moment;  // ... and start at 0 in the moments
};

// The optimizer state of one target (pipeline, tensor) rank.
struct OptimizerStagePlan {
  int pp_rank = 0, tp_rank = 0;
  std::vector<FlatGroup> groups;                      // flat layout and DP partitions
  std::vector<std::vector<OptimizerSlotPlan>> slots;  // [group][slot]
  // DeepSpeed MoE: the plan is that of EP rank `ep_rank` of `ep`, held by the
  // DP ranks d with d % ep == ep_rank. Its expert groups (expert_group[g])
  // hold this EP rank's experts, partitioned over expert-DP: rank d has
  // partition d / ep of them (the others are partitioned over all DP ranks).
  int ep = 1, ep_rank = 0;
  std::vector<bool> expert_group;  // per group; empty: none
  // The partition of group `g` DP rank `d` holds.
  int PartitionOf(int g, int d) const {
    return !expert_group.empty() && expert_group[g] ? d / ep : d;
  }
};

struct PlanOptions {
  int tp = 1, pp = 1, dp = 0;  // dp 0 = keep the source's
  // Explicit blocks per target stage; empty = the partition method recorded.
  std::vector<int> layers_per_stage;
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  std::optional<int64_t> vocab_size;  // true vocabulary size when not recorded
  double vocab_pad_value = 0;         // new vocabulary padding rows
  bool weights_only = false;          // write no optimizer state
};

// The plan options a conversion's options give.
PlanOptions PlanOptionsFrom(const DeepSpeedPlanOptions& options);

struct DeepSpeedPlan {
  int tp = 1, pp = 1, dp = 1;
  bool pipeline = true;          // false: a non-pipeline checkpoint's DP change
  int64_t padded_vocab = 0;      // target rows of vocabulary tensors (0: none)
  std::vector<int> stage_bounds;  // stage p owns specs [b[p], b[p+1])
  std::vector<LayerFilePlan> layer_files;
  std::vector<ModelStatesPlan> model_states;
  // Optimizer state per model_states entry (empty: none written); in shard
  // files, or for the embedded formats (FP16_Optimizer, torch) inside the
  // mp_rank files.
  std::vector<OptimizerStagePlan> optimizer;
  OptimizerFormat optimizer_format;
  bool drop_embedded_optimizer = false;  // weights only: the mp_rank `optimizer` becomes None
  std::vector<std::string> notes;  // merges, fills and other things to tell the user

  // For the dry run: the target in one line; what an mp_rank file is; how
  // the flat groups of `stage` are laid out and what DP rank `d`'s
  // partition holds (for the torch format, every parameter's state index).
  std::string Summary() const;
  std::string ModelStatesWhat(const ModelStatesPlan& m) const;
  std::vector<std::string> OptimizerDetail(const OptimizerStagePlan& stage, int d) const;
};

// For the dry run: where the tensors of an optimizer state come from, which
// OptimizerDetail's lines lay out.
inline constexpr char kOptimizerStateFrom[] = "the optimizer state the group lines below lay out";

// A pipeline checkpoint at another TP / PP / DP; `opt` (may be null) is the
// source's optimizer state, planned along when not weights-only.
Result<DeepSpeedPlan> MakePipelinePlan(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                       const PlanOptions& options);

// A non-pipeline checkpoint keeps its TP layout and its one stage; the
// mp_rank files and optimizer shards are rewritten for the new DP size.
Result<DeepSpeedPlan> MakeDataParallelPlan(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                           const PlanOptions& options);

}  // namespace reshard
