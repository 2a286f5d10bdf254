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
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formats/deepspeed/checkpoint_files.h"
#include "formats/deepspeed/moe_layout.h"
#include "formats/deepspeed/source_optimizer.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// The name a tensor of a MoE reader's layer was saved under: `<spec>.<key>`
// or the module path; an expert's with its global id.
std::string MoeSaveName(const LogicalLayer& layer, const LogicalTensor& t);

class MoeOptimizer : public SourceOptimizer {
 public:
  // Reads every shard of every mp rank; errors name the file and what does
  // not add up (a parameter without state, fragments that do not cover it).
  static Result<std::unique_ptr<MoeOptimizer>> Load(const LogicalCheckpoint& ckpt, const CheckpointFiles& files,
                                                    const MoeLayout& layout,
                                                    const std::set<std::string>& allowed_classes);

  const OptimizerFormat& format() const override { return format_; }
  const std::vector<std::string>& states() const override { return states_; }
  const std::vector<std::string>& scalar_states() const override { return scalar_states_; }
  int num_groups() const override { return num_groups_; }
  int tp() const override { return tp_; }
  const Value& Template() const override { return shards_[0][0]; }
  std::vector<std::string> ParamNames() const override;
  bool Has(const std::string& name) const override { return where_.count(name) > 0; }
  Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const override;

  // What a conversion is built from.
  // DP rank d's shard on mp rank `mp` (a target shard's template).
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
  };
  // An expert's name on its EP rank, and that rank.
  struct LocalName {
    std::string name;
    int ep = -1;  // -1: not an expert (the groups of every DP rank)
  };

  Status LoadRank(int mp, const std::vector<const OptimizerShardFile*>& shards,
                  const std::set<std::string>& allowed_classes);
  Status IndexGroup(int mp, int group, bool moe, const std::vector<const OptimizerShardFile*>& shards);
  void DetectStates();
  // The partition of `state` in group `group` of DP rank `d`'s shard on mp rank `mp`.
  const Tensor* Partition(int mp, int d, int group, const std::string& state) const;
  Status CheckCoverage(const LogicalCheckpoint& ckpt) const;

  OptimizerFormat format_;
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
