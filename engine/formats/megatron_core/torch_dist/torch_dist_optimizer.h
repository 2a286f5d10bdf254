// The distributed optimizer's state in a Megatron-Core `torch_dist`
// checkpoint, each state of each model key presented as the model key is:
// a DcpTensor of the key's global shape whose chunks are the key's own
// boxes. The torch_dist import then slices them exactly like the weights.
//
// Megatron-Core 0.19's two layouts (dcp-torch-dist-format.md §4):
//   fully_reshardable  `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`
//                      already have the model's shapes and chunks; the
//                      param groups and step are in the common state.
//   dp_reshardable     flat fp32 buffers per model-parallel rank, grad buffer
//                      and bucket (megatron_buckets.h). Each parameter's
//                      slice is its TP rank's piece, flattened: cut where the
//                      bucket layout says, from the parameters in the rule
//                      set's registration order (torch_dist.optimizer_order),
//                      and placed at that piece's boxes of the model key
//                      (two for a SwiGLU linear_fc1: [gate_r; up_r]). The
//                      param groups are per rank's `optimizer` item. A model
//                      with experts at EP > 1 (a ChainedOptimizer) keeps the
//                      dense parameters' buffers under `chained_0.` and each
//                      (TP, EP, PP) rank's experts' under `chained_1.`; its
//                      two optimizers' groups are read as one's.
// Megatron-Core 0.14's layouts:
//   fully_sharded_model_space  `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>`
//                      reformulated (nd_reformulation.h): each fragment of
//                      the key (a layer's TP piece), flattened, is placed at
//                      its box of the key. The param groups and step are in
//                      the common state (common.pt).
//   dp_zero_gather_scatter  each model-parallel rank's state gathered onto
//                      DP rank 0 and pickled whole, `...dp_group_idx_{i}.param_state`
//                      (formats/megatron_core/common/megatron_gathered.h): the buckets of
//                      dp_reshardable one after the other, placed the same
//                      way. The param groups are per rank's `optimizer` item.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "formats/dcp_common/dcp_content.h"
#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "rules/rule_set.h"

namespace reshard {

struct TorchDistOptimizer {
  std::string layout;  // the common state's param_state_sharding_type
  // state -> model key -> the state shaped and chunked like the key.
  std::map<std::string, std::map<std::string, DcpTensor>> states;
  std::vector<Value> param_groups;  // as saved, without `params`
  std::optional<Value> step;        // the groups' `step`, where they record one
  std::vector<std::string> notes;   // what reading it assumed
};

// What a dp_reshardable layout is read with that the checkpoint may not
// record: the args value at `path` (args.tensor_model_parallel_size, ...),
// from the checkpoint's args or --set.
using ArgsLookup = std::function<std::optional<int64_t>(const std::string& path)>;

// Whether `fqn` is an item of the distributed optimizer's state, which
// Megatron-Core saves under "optimizer.".
bool IsOptimizerKey(const std::string& fqn);

// The optimizer state of `content` (nullopt when it holds none), `common`
// its common state. Errors: a layout reshard does not read, named with the
// fix (--weights-only); per_bucket_numel that the rule set's registration
// order does not explain; a state missing for a model key; a reformulated
// state whose shape does not fit its key's.
Result<std::optional<TorchDistOptimizer>> ReadTorchDistOptimizer(const DcpContent& content, const Value& common,
                                                                 const TorchDistLayout& layout,
                                                                 const ArgsLookup& args);

}  // namespace reshard
