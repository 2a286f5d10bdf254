// Reading a model stored under Megatron-Core's keys as the pipeline model of
// a rule set's `torch_dist` section: what the torch_dist import (a DCP
// folder) and the Megatron-LM `torch` import (one state dict per rank) share.
//
// The format finds the canonical tensors' elements; this records what the
// run's args say under the names the rules read (`torch_dist.args`), the
// sizes the section's shapes take from the tensors where the args do not
// record them, the family's conditions where nothing says otherwise, and
// lays the canonical tensors out in the rule set's layer files at TP 1, PP 1
// (imported_layers.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "formats/megatron_core/common/torch_dist_rules.h"
#include "logical/imported_layers.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"
#include "rules/rule_set.h"

namespace reshard {

// `name` with "{block}" replaced by `block`.
std::string WithBlock(std::string name, int64_t block);
// `name` with "{expert}" replaced by `expert`.
std::string WithExpert(std::string name, int64_t expert);
// Whether `entry`'s key stacks the experts of each layer (its name has
// {expert}): on the axis after the layer axis.
bool StacksExperts(const TorchDistTensor& entry);

// What an import records of the run state `state` (a common state dict, a
// Megatron-LM rank file's object): `args` (an empty Namespace when None or
// absent), `iteration` (`fallback` when absent), and the learning-rate
// scheduler's state as `lr_scheduler` (the key DeepSpeed sources record it
// by), from Megatron-LM's opt_param_scheduler or its legacy lr_scheduler.
Value ImportedRunMetadata(const Value& state, int64_t fallback);

// Refuses the run state `state` (a common state dict, a Megatron-LM rank
// file's object; `where` names it) when it is not a dict, or its args are
// not an argparse.Namespace or its iteration not an int: the import would
// lose them silently.
Status CheckRunState(const Value& state, const std::string& where);

// The rule sets that may read a Megatron-Core model: `spec` (--rules) alone,
// which must have a torch_dist section (`what` names the checkpoint kind for
// the message), else every built-in set that has one.
Result<std::vector<RuleSet>> TorchDistCandidates(const std::string& spec, const std::string& what);

// One rule set's reading of one checkpoint. Call Start, then CheckShape for
// each canonical tensor found, RecordBlocks, Satisfy and Finish.
class TorchDistFamily {
 public:
  // `label` starts the notes ("torch_dist", "megatron"); `run` is
  // ImportedRunMetadata's.
  TorchDistFamily(const RuleSet& rules, Value run, const CommonOptions& options, std::string label);

  // The --set values, and the args under the names the rules read.
  Status Start();
  // Checks `shape` (without a layer axis) of the canonical tensor of `entry`,
  // stored as `key`, against the entry's shape; a size the args do not record
  // is taken from it (the first that meets it), the others must agree.
  Status CheckShape(const TorchDistTensor& entry, const std::string& key, const std::vector<int64_t>& shape);
  // Records the checkpoint's number of blocks; refused when its args say another.
  Status RecordBlocks(int64_t blocks, const std::string& folder);
  // Records the experts of each MoE layer (0: none); refused when its args
  // (num_moe_experts) say another number, or, for a family with experts,
  // mix dense and MoE layers (moe_layer_freq), which is not read yet.
  Status RecordExperts(int64_t experts, const std::string& folder);
  // The family's conditions (detect.args, and what its HF export requires)
  // set where nothing records them (a note lists them); refused where the
  // args describe another model.
  Status Satisfy();
  // The model's canonical tensors laid out and described at TP 1, PP 1, with
  // the args of that layout; `source_of(name)` names the stored tensors a
  // missing canonical tensor is made of.
  Result<LogicalCheckpoint> Finish(const std::map<std::string, ImportedTensor>& tensors,
                                   const std::function<std::string(const std::string&)>& source_of,
                                   const std::string& folder);

  // The rule of canonical tensor `name` at `blocks` blocks (of the experts
  // RecordExperts recorded); an error when no layer of the rule set holds it.
  Result<const ParamRule*> RuleOf(const std::string& name, int64_t blocks) const;
  // The entry of `key` (any alternative name of it), stacked keys without a
  // layer index; null when the section maps no tensor to it.
  const TorchDistTensor* EntryOf(const std::string& key) const;

  // The stored keys (alternatives) canonical tensor `name` is read from;
  // "" when the section maps none to it. After RecordBlocks.
  std::string KeysOf(const std::string& name) const;

  RuleInputs inputs() const { return RuleInputs{ckpt_.metadata[0], ckpt_.settings}; }
  Value* metadata() { return &ckpt_.metadata[0]; }
  const RuleSet& rules() const { return rules_; }
  const TorchDistLayout& layout() const { return layout_; }
  std::vector<std::string>& notes() { return notes_; }
  // Unsupported, naming the rule set: the next candidate may read it.
  Status Refuse(const std::string& why) const;

 private:
  void RenameArgs();
  void RecordSettings();
  DType WeightDType(const std::map<std::string, ImportedTensor>& tensors) const;

  const RuleSet& rules_;
  const TorchDistLayout& layout_;
  const CommonOptions& options_;
  const std::string label_;
  LogicalCheckpoint ckpt_;
  int64_t blocks_ = 0;
  int64_t experts_ = 0;
  std::vector<std::string> notes_;
};

}  // namespace reshard
