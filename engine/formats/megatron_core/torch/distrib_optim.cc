#include "formats/megatron_core/torch/distrib_optim.h"

#include <algorithm>
#include <map>

#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/torch_dist_rules.h"

namespace reshard {

Result<std::vector<std::string>> ChunkKeysInRegistrationOrder(const TorchDistLayout& layout, int stage, int chunk,
                                                              const PipelineStages& stages) {
  std::vector<std::string> keys;
  const int64_t first = stages.ChunkFirst(stage, chunk);
  // The torch format is read and written for models without experts.
  for (const RegisteredParam& reg : ChunkRegistrationOrder(layout, stages, stage, chunk, layout.tied_head, {})) {
    if (reg.layer < 0) {
      keys.push_back(reg.key);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(std::string key, LayerKey(reg.key, static_cast<int>(reg.layer - first)));
    keys.push_back(std::move(key));
  }
  return keys;
}

Result<Value> DistribOptimValue(const TorchDistLayout& layout, int stage, const PipelineStages& stages,
                                std::vector<RankParamState> params, int dp,
                                const std::function<DType(DType)>& grad_dtype) {
  std::map<std::pair<int, std::string>, size_t> by_key;  // (chunk, key)
  for (size_t i = 0; i < params.size(); ++i) by_key[{params[i].param.chunk, params[i].param.name}] = i;
  std::vector<RankParamState> ordered;
  for (int chunk = 0; chunk < stages.vpp(); ++chunk) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> order,
                             ChunkKeysInRegistrationOrder(layout, stage, chunk, stages));
    for (const std::string& key : order) {
      auto it = by_key.find({chunk, key});
      if (it == by_key.end()) continue;  // a key of the family this model lacks
      ordered.push_back(std::move(params[it->second]));
      by_key.erase(it);
    }
  }
  if (!by_key.empty()) {
    return Status::Unsupported(by_key.begin()->first.second + " is not in the rule set's torch_dist.optimizer_order, the "
                               "registration order distrib_optim.pt's buffers follow; add it (docs/rules.md) or "
                               "export with --weights-only");
  }
  std::vector<GatheredParam> list;
  for (const RankParamState& p : ordered) list.push_back(p.param);
  BucketOptions options;
  options.dp = dp;
  RESHARD_ASSIGN_OR_RETURN(std::vector<GradBuffer> buffers, MegatronGradBuffers(list, options));
  auto state_bytes = [&ordered](size_t param, int state) { return ordered[param].states[state]; };
  return GatheredStateValue(buffers, grad_dtype, state_bytes);
}

}  // namespace reshard
