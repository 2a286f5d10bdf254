// ShardOptimizer: the optimizer state of a DeepSpeed tag folder, read per
// parameter (a SourceOptimizer).
//
// DeepSpeed's BF16 optimizer and ZeRO-1/2 store, per (pipeline, tensor) rank
// and DP rank, one flat fp32 partition per parameter group for the master
// weights and one for every per-element optimizer state (Adam's exp_avg and
// exp_avg_sq, a momentum buffer, ...). ShardOptimizer opens those files
// (tensor data stays memory-mapped), rebuilds every group's flat layout from
// `param_shapes` and the alignment rule — checking it against the partition
// sizes and, where the files have them, param_slice_mappings — and gathers
// any parameter's state back into the TP-local tensor it belongs to.
//
// Without ZeRO the state sits in each mp_rank file's `optimizer` instead:
// FP16_Optimizer's unpartitioned flats, or for fp32 the plain torch
// optimizer's state_dict, one tensor per parameter and state, which needs no
// flat layout to be located.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/model/flat_group.h"
#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "plan/materialize.h"

namespace reshard {

// True when the mp_rank files hold an optimizer state (FP16_Optimizer
// without ZeRO, or a plain torch optimizer).
bool HasEmbeddedOptimizerState(const LogicalCheckpoint& src);

class ShardOptimizer : public SourceOptimizer {
 public:
  // Errors name the file and what does not add up.
  // `files` are the shard files; none: the state inside the mp_rank files.
  static Result<std::unique_ptr<SourceOptimizer>> Load(const LogicalCheckpoint& src,
                                                       const std::vector<OptimizerShardFile>& files,
                                                       const std::set<std::string>& allowed_classes);

  const OptimizerFormat& format() const override { return format_; }
  const std::vector<std::string>& states() const override { return states_; }
  const std::vector<std::string>& scalar_states() const override { return scalar_states_; }
  int num_groups() const override { return num_groups_; }
  int tp() const override { return tp_; }
  const Value& Template() const override { return stages_[0].shards[0]; }
  std::vector<std::string> ParamNames() const override;
  bool Has(const std::string& name) const override { return owner_.count(name) > 0; }
  // The pieces of the flattened elements in each DP partition, from the
  // first pipeline stage that has the parameter (for tied parameters, the
  // embedding's stage).
  Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const override;

 private:
  // The flats of one (pipeline, tensor) rank.
  struct Stage {
    std::vector<FlatGroup> groups;
    std::vector<Value> shards;  // per DP rank
    // flats[state][group][dp rank]
    std::map<std::string, std::vector<std::vector<const Tensor*>>> flats;
    // The per-parameter format: tensors[state][group][slot].
    std::map<std::string, std::vector<std::vector<const Tensor*>>> tensors;
  };
  Status LoadStage(const LogicalCheckpoint& src, int mp, const std::vector<std::string>& paths,
                   const std::set<std::string>& allowed_classes);
  Status LoadEmbeddedStage(const LogicalCheckpoint& src, int mp, const std::vector<int>& bounds);
  Status DetectFormat(const Value& first_shard, const FlatGroup& first_group, const std::string& path);
  // FP16_Optimizer's flats or a plain torch state_dict, from mp_rank_00's `optimizer`.
  Status DetectEmbeddedFormat(const Value& optimizer, const FlatGroup& first_group);
  // The per-element states: tensors of group 0's state as long as its partition.
  void DetectStates(const Value& first_shard, const FlatGroup& first_group);
  // The per-parameter format's states: those of its first parameter shaped
  // like it are per-element, the others scalar.
  void DetectParamStates(const Value& optimizer, const FlatGroup& first_group);
  Status AddEmbeddedFlats(int mp, Stage* stage);
  Status AddParamStates(int mp, Stage* stage);
  // One parameter's state in the per-parameter format: the per-element
  // states recorded in stage->tensors, the scalars checked against the first's.
  Status AddParamState(const Value* state, const FlatSlot& slot, int group, int slot_index,
                       int64_t index, const std::string& file, Stage* stage);
  // Every stage must have the same number of (non-empty) groups as stage 0.
  Status CheckGroupCount(size_t groups, int mp);
  Status CheckSameScalars(const Value& first, const Value& shard, const std::string& file) const;

  OptimizerFormat format_;
  std::vector<std::string> states_;
  std::vector<std::string> scalar_states_;
  int num_groups_ = 0;
  int tp_ = 1;
  std::vector<Stage> stages_;          // index = mp rank (p * tp + t)
  // Where a parameter's state is: the first pipeline stage holding it, and its
  // group and slot there (the same on every TP rank of the stage).
  struct Owner {
    int stage = 0;
    int group = 0;
    int slot = 0;
  };
  std::map<std::string, Owner> owner_;
};

}  // namespace reshard
