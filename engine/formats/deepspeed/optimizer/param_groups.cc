#include "formats/deepspeed/optimizer/param_groups.h"

#include "formats/deepspeed/files/torch_state.h"
#include "formats/deepspeed/model/stages.h"

namespace reshard {
namespace {

constexpr char kStep[] = "step";

// The torch optimizer state dict inside a template: DeepSpeed's ZeRO and
// BF16 shards nest it as optimizer_state_dict.base_optimizer_state,
// FP16_Optimizer as optimizer_state_dict; the per-parameter format is one.
const Value* TorchStateDict(const Value& tmpl) {
  const Value* osd = Find(tmpl, "optimizer_state_dict");
  if (osd == nullptr) return &tmpl;
  const Value* base = Find(*osd, "base_optimizer_state");
  return base != nullptr ? base : osd;
}

// torch keeps the step in each parameter's (here: flat group's) state; some
// formats record it in the groups instead.
std::optional<Value> FindStep(const Value& torch_sd, const std::vector<Value>& groups) {
  const Value* state = Find(torch_sd, "state");
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  if (items != nullptr && !items->empty()) {
    if (const Value* step = Find(items->front().second, kStep)) return *step;
  }
  if (const Value* step = Find(groups.front(), kStep)) return *step;
  return std::nullopt;
}

}  // namespace

Result<OptimizerParamGroups> SourceParamGroups(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt) {
  const Value* torch_sd = TorchStateDict(opt.Template());
  const std::vector<Value>* groups = torch_sd != nullptr ? ParamGroups(*torch_sd) : nullptr;
  if (groups == nullptr || groups->empty()) {
    return Status::Unsupported("the optimizer state records no param_groups to write the target's from; "
                               "export with --weights-only");
  }
  const StageParameters whole = StageParams(ckpt, 0, static_cast<int>(ckpt.specs.size()), 1, ckpt.vocab.padded_rows);
  if (whole.groups.size() != groups->size()) {
    return Status::Unsupported("the optimizer has " + std::to_string(groups->size()) + " param groups where rule set " +
                               ckpt.rules->name() + "'s optimizer_groups make " +
                               std::to_string(whole.groups.size()) + "; export with --weights-only");
  }
  OptimizerParamGroups out;
  out.step = FindStep(*torch_sd, *groups);
  for (size_t g = 0; g < groups->size(); ++g) {
    if (DictItems((*groups)[g]) == nullptr) {
      return Status::InvalidInput("optimizer param group " + std::to_string(g) + " is not a dict; export with --weights-only");
    }
    OptimizerParamGroup group;
    group.hyperparameters = GroupHyperparameters((*groups)[g]);
    group.weight_decay_multiplier = GroupDecays(whole.groups[g]) ? 1.0 : 0.0;
    for (const ParamShape& p : whole.groups[g]) {
      int li = 0, ti = 0;
      if (!ResolveParamName(ckpt, p.first, &li, &ti)) return Status::Internal("no tensor for parameter " + p.first);
      group.params.push_back(ckpt.layers[li].tensors[ti].name);
    }
    out.groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace reshard
