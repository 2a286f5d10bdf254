// Zero3Checkpoint: a DeepSpeed ZeRO stage 3 checkpoint, and its conversion
// to another data-parallel size.
//
// Under ZeRO-3 every DP rank writes zero_pp_rank_{d}_mp_rank_{mm}_model_states.pt
// (empty parameter placeholders, full shapes in `param_shapes`, one dict per
// optimizer sub-group) and {bf16_}zero_pp_rank_{d}_mp_rank_{mm}_optim_states.pt.
// Each parameter of n elements is padded to ceil(n/DP)·DP and rank d holds
// its d-th ceil(n/DP) slice; a sub-group's flat is its parameters' slices
// back to back, and sub-groups are cut every `sub_group_size` partition
// elements within each parameter group. Changing DP re-slices every
// parameter and re-cuts the sub-groups; the model's tensor layout is
// untouched (ZeRO-3 checkpoints hold no layer files).
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <atomic>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "logical/source_shard.h"
#include "pickle/value.h"
#include "plan/output_plan.h"

namespace reshard {

struct Zero3Target;

struct Zero3Param {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

// Where a parameter's slices lie in its rank's flats.
struct Zero3Slot {
  int sub_group = 0;
  int64_t offset = 0;  // elements of the sub-group's flats before its slice
  int64_t numel = 0;
};

// One model-parallel rank's ZeRO-3 state across its DP ranks.
struct Zero3Rank {
  std::vector<Value> model_states;  // per DP rank
  std::vector<Value> optimizer;     // per DP rank
  std::vector<std::vector<Zero3Param>> sub_groups;
  std::vector<std::vector<int>> group_sub_groups;  // param group -> its sub-group ids
  std::map<std::string, Zero3Slot> slots;  // by parameter name
};

class Zero3Checkpoint {
 public:
  // Reads and checks every file; errors name the file and what does not add up.
  static Result<std::unique_ptr<Zero3Checkpoint>> Load(const CheckpointFiles& files,
                                                       const std::set<std::string>& allowed_classes);

  int mp() const { return static_cast<int>(ranks_.size()); }
  int dp() const { return dp_; }
  int64_t iteration() const;
  // kMasterState ("fp32") then the optimizer's per-element states.
  const std::vector<std::string>& states() const { return states_; }
  const std::vector<Zero3Rank>& ranks() const { return ranks_; }

  // Where the fp32 `state` of parameter `name` on model-parallel rank `mp`
  // lies: its slice in every DP rank's flat (nothing is copied).
  Result<SourceShard> Locate(int mp, const std::string& name, const std::string& state) const;

  // "ZeRO-3, TP 1, DP 4; iteration 10; 8 sub-groups in 2 groups; states fp32, exp_avg"
  std::string Summary() const;

  // Every file of the checkpoint at `target_dp`, whose flats are produced
  // from this checkpoint's while written (adding the bytes read to *read);
  // this checkpoint must outlive them.
  Result<std::vector<PlannedFile>> Files(int target_dp, bool bf16_prefix, std::atomic<int64_t>* read) const;

 private:
  Status LoadRank(int mp, const std::set<std::string>& allowed_classes);
  // Sub-groups of rank `mp` re-cut for `target_dp`, parameter group by group.
  Zero3Target Retarget(int mp, int target_dp) const;
  Value TargetModelStates(int mp, const Zero3Target& target, int d) const;
  // DP rank d's optimizer file, its flats produced from this checkpoint's.
  Value TargetOptimizer(int mp, const std::shared_ptr<const Zero3Target>& target, int d,
                        std::atomic<int64_t>* read) const;
  // DP rank d's flat of `state` for the target's sub-group `sg`, produced a
  // range at a time: each parameter's slice, zero-padded to ceil(n/DP),
  // located in the source flats when reached (located slices held for every
  // flat would grow with the parameters).
  Value FlatTensor(int mp, const std::shared_ptr<const Zero3Target>& target, size_t sg, const std::string& state,
                   int d, std::atomic<int64_t>* read) const;
  const Value* Flat(int mp, int d, int sub_group, const std::string& state) const;

  CheckpointFiles files_;
  int dp_ = 0;
  int64_t sub_group_size_ = 1000000000;
  std::vector<std::string> states_;
  std::vector<Zero3Rank> ranks_;
};

}  // namespace reshard
