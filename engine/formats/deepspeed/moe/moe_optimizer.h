// MoeOptimizer: the ZeRO-1/2 optimizer state of a DeepSpeed MoE save, per
// parameter (a SourceOptimizer).
//
// A MoE save records no param_shapes; its shards' param_slice_mappings
// place every fragment. The non-expert groups are partitioned over all DP
// ranks; the expert groups (`moe: True`) of EP rank r over the ranks
// d % EP == r (expert-DP), under EP-local names: the same name is expert
// r * E/EP + local on EP rank r. Parameters are named here as saved, experts
// by their global id (the names of the expert files), so each one's state is
// found whatever EP it was trained at.
//
// Without ZeRO (fp32, a plain torch optimizer) each EP rank's torch
// state_dict is in its expp_rank file instead, one state per parameter and
// no names: its indices run through the groups in order, each group holding
// the stage's parameters DeepSpeed puts there (the rule set's groups without
// experts, then each one's experts of that EP rank, in named_parameters()
// order). The non-expert states, alike on every EP rank, are read from EP
// rank 0's file, and every other rank's copy is checked equal to them.
//
// BF16_Optimizer (bf16 without ZeRO, or ZeRO-1 with an fp32 gradient
// accumulation dtype) writes shards like ZeRO's, its fp32 partitions whole.
// Without ZeRO each expp_rank file r also holds a copy of DP rank r's
// optimizer_state_dict. DeepSpeed (0.14-0.16) loads the state from the
// shards, not the copies, so a conversion writes the copies from its shards.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/model/flat_group.h"
#include "formats/deepspeed/moe/moe_layout.h"
#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// The name a tensor of a MoE reader's layer was saved under: `<spec>.<key>`
// or the module path; an expert's with its global id.
std::string MoeSaveName(const LogicalLayer& layer, const LogicalTensor& t);

// The torch optimizer state_dict in a shard of `format`: ZeRO's
// base_optimizer_state, or without ZeRO the shard itself (null when malformed).
const Value* MoeTorchState(const Value& shard, const OptimizerFormat& format);
Value* MutableMoeTorchState(Value* shard, const OptimizerFormat& format);

// Whether the save's expp_rank files hold an optimizer state (as mp rank 0's
// EP rank 0 file tells): without ZeRO they do; under ZeRO they hold None.
Result<bool> ExppHoldsState(const CheckpointFiles& files, const std::set<std::string>& allowed_classes);

class MoeOptimizer : public SourceOptimizer {
 public:
  // Reads every shard of every mp rank; errors name the file and what does
  // not add up (a parameter without state, fragments that do not cover it).
  static Result<std::unique_ptr<MoeOptimizer>> Load(const LogicalCheckpoint& ckpt, const CheckpointFiles& files,
                                                    const MoeLayout& layout,
                                                    const std::set<std::string>& allowed_classes);
  // The state of a save without ZeRO, from its expp_rank files; the groups
  // are checked against DeepSpeed's (sizes, `moe` flags, state shapes).
  // `stage_bounds`: stage p holds the layers with ids [b[p], b[p+1]).
  static Result<std::unique_ptr<MoeOptimizer>> LoadTorch(const LogicalCheckpoint& ckpt, const CheckpointFiles& files,
                                                         const MoeLayout& layout, const std::vector<int>& stage_bounds,
                                                         const std::set<std::string>& allowed_classes);

  const OptimizerFormat& format() const override { return format_; }
  // Whether each expp_rank file holds a copy of its EP rank's first shard
  // (BF16_Optimizer without ZeRO).
  bool shard_copies_in_expp() const { return shard_copies_in_expp_; }
  const std::vector<std::string>& states() const override { return states_; }
  const std::vector<std::string>& scalar_states() const override { return scalar_states_; }
  int num_groups() const override { return num_groups_; }
  int tp() const override { return tp_; }
  const Value& Template() const override { return shards_[0][0]; }
  std::vector<std::string> ParamNames() const override;
  bool Has(const std::string& name) const override { return where_.count(name) > 0; }
  Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const override;

  // What a conversion is built from.
  // DP rank d's shard on mp rank `mp` (a target shard's template); without
  // ZeRO, EP rank d's torch state_dict.
  const Value& Shard(int mp, int d) const { return shards_[mp][d]; }
  int Groups(int mp) const { return static_cast<int>(moe_groups_[mp].size()); }
  bool IsExpertGroup(int mp, int group) const { return moe_groups_[mp][group]; }
  // The names (as saved on EP rank `ep`; -1 for the other groups) in group
  // `group`'s flat on mp rank `mp`, in flat order.
  std::vector<std::string> GroupOrder(int mp, int group, int ep) const;
  // The group parameter `name` (saved name, experts by global id) is in on
  // mp rank `mp`; -1 when it is not there.
  int GroupOf(const std::string& name, int mp) const;
  // The name `name` has in the shards, and its EP rank (-1: not an expert).
  std::pair<std::string, int> LocalNameOf(const std::string& name) const;

 private:
  // One DP rank's fragment of a parameter.
  struct Fragment {
    int dp = 0;
    int64_t start = 0;  // in the rank's partition
    int64_t numel = 0;
  };
  // Where a parameter's state is on one mp rank: its group and fragments in
  // element order.
  struct Place {
    int group = 0;
    std::vector<Fragment> fragments;
    int64_t index = -1;  // without ZeRO: the parameter's index in its torch state_dict
  };
  // An expert's name on its EP rank, and that rank.
  struct LocalName {
    std::string name;
    int ep = -1;  // -1: not an expert (the groups of every DP rank)
  };

  // The saved names of every parameter, and each one's name on its EP rank.
  void IndexNames(const LogicalCheckpoint& ckpt, const MoeLayout& layout);
  // Places EP rank `r`'s torch state on mp rank `mp` (the layers [lo, hi)).
  Status IndexTorchRank(const LogicalCheckpoint& ckpt, int mp, int r, int lo, int hi, const std::string& file);
  // The per-element states (shaped like the first parameter) and the scalar ones of a torch state_dict.
  void DetectTorchStates(const Value& state_dict, const std::vector<int64_t>& first_shape);
  // Records parameter `name`'s state at `index`, checking it has every state.
  Status AddTorchParam(const Value& state_dict, const ParamShape& param, int64_t index, const std::string& file);
  // A non-expert parameter's states on EP rank r (index `index`) against EP rank 0's.
  Status CheckSameAsEpRankZero(int mp, int r, const ParamShape& param, int64_t index, const std::string& file) const;
  Status LoadRank(int mp, const std::vector<const OptimizerShardFile*>& shards,
                  const std::set<std::string>& allowed_classes);
  Status IndexGroup(int mp, int group, bool moe, const std::vector<const OptimizerShardFile*>& shards);
  void DetectStates();
  // The partition of `state` in group `group` of DP rank `d`'s shard on mp rank `mp`.
  const Tensor* Partition(int mp, int d, int group, const std::string& state) const;
  // Without ZeRO: `state` of the parameter at `place` in EP rank `ep`'s torch state.
  Result<SourceShard> TorchStateOf(int mp, int ep, const Place& place, int t, const std::string& state) const;
  Status CheckCoverage(const LogicalCheckpoint& ckpt) const;

  OptimizerFormat format_;
  bool shard_copies_in_expp_ = false;
  std::vector<std::string> states_;
  std::vector<std::string> scalar_states_;
  int num_groups_ = 0;
  int tp_ = 1;
  int ep_ = 1;
  std::vector<std::vector<Value>> shards_;  // [mp][dp]
  std::vector<std::vector<bool>> moe_groups_;  // [mp][group]: an expert group
  // (mp, local name, EP rank or -1) -> place
  std::map<std::tuple<int, std::string, int>, Place> places_;
  std::map<std::string, LocalName> where_;  // saved name (global) -> name in the shards
  std::vector<std::string> names_;          // in layer order
};

}  // namespace reshard
