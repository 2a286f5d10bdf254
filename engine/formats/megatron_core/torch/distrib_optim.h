// Megatron-LM's `distrib_optim.pt`: the distributed optimizer's state of one
// (TP, PP) rank of a `torch` checkpoint saved with --use-distributed-optimizer,
// beside the rank's model_optim_rng.pt. It is the rank's buffers gathered
// onto DP rank 0 (DistributedOptimizer.save_parameter_state; the object is
// formats/megatron_core/common/megatron_gathered.h's), which load_parameter_state scatters back
// at the loading run's DP size: the file does not depend on DP.
//
// The rank's parameters are its model_optim_rng.pt's Megatron-Core keys
// (layer indices local to the model chunk), in the order each chunk
// registers them: the rule set's torch_dist.optimizer_order
// (megatron_layout.h, ChunkRegistrationOrder), each TP piece flattened as
// the rank holds it; with a virtual pipeline each chunk's buffers follow
// the previous chunk's.
// model_optim_rng.pt's `optimizer` entry then holds what
// DistributedOptimizer.state_dict() gives: `{'optimizer': {'param_groups':
// [...]}}` (no `state`: the states are in distrib_optim.pt), and
// `grad_scaler` for a run that has one.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/megatron_core/common/megatron_gathered.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "rules/rule_set.h"

namespace reshard {

// The file name beside model_optim_rng.pt.
inline constexpr char kDistribOptimFile[] = "distrib_optim.pt";

// The model keys of model chunk `chunk` of stage `stage` of `stages` in
// registration order (ChunkRegistrationOrder): every key optimizer_order can
// give, the layer keys with the chunk's own layer index, the tied head's on
// the last chunk; the caller skips those the model lacks.
Result<std::vector<std::string>> ChunkKeysInRegistrationOrder(const TorchDistLayout& layout, int stage, int chunk,
                                                              const PipelineStages& stages);

// One parameter of a rank, for the export.
struct RankParamState {
  GatheredParam param;  // name: its model key; chunk: its model chunk
  std::array<ByteProducer, 3> states;  // fp32 master, exp_avg, exp_avg_sq (kTorchDistStates), fp32
};

// The distrib_optim.pt object of stage `stage` of a rank whose parameters
// are `params` (any order), at `dp` DP ranks: each model chunk's grad
// buffers, chunk by chunk; `grad_dtype(param dtype)` is
// the run's gradient dtype. Unsupported, naming the key, for a parameter
// optimizer_order does not place.
Result<Value> DistribOptimValue(const TorchDistLayout& layout, int stage, const PipelineStages& stages,
                                std::vector<RankParamState> params, int dp,
                                const std::function<DType(DType)>& grad_dtype);

}  // namespace reshard
