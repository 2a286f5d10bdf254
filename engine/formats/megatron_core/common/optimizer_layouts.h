// The names Megatron-Core gives the layouts of its distributed optimizer's
// state in a torch_dist checkpoint (`param_state_sharding_type`), which the
// torch_dist reader reads and its writer writes: 0.19's fully_reshardable
// (every state shaped like its model key) and dp_reshardable (flat buckets
// per model-parallel rank), 0.14's fully_sharded_model_space (every rank's
// piece of a state flattened) and dp_zero_gather_scatter (the buckets
// gathered onto DP rank 0).
#pragma once

namespace reshard {

inline constexpr char kFullyReshardable[] = "fully_reshardable";
inline constexpr char kDpReshardable[] = "dp_reshardable";
inline constexpr char kFullyShardedModelSpace[] = "fully_sharded_model_space";
inline constexpr char kDpZeroGatherScatter[] = "dp_zero_gather_scatter";

}  // namespace reshard
