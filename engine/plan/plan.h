// Plan: what a conversion will write, as plain data.
//
// For every target file the plan lists every tensor and, for each, which
// slices of which source shards fill it (SliceCopy), which rows are new
// padding (SliceFill), or that it is the mean of its replicas. Making a plan
// reads no tensor data; printing it is `convert --dry-run`; executing it is
// the executor's only job. Tests assert on plans without touching disk.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

// Copies indices [src_start, src_start + length) of `dim` of source TP rank
// `src_rank`'s shard into [dst_start, dst_start + length) of the target
// tensor; every other dimension is taken whole.
struct SliceCopy {
  int src_rank = 0;
  int dim = 0;
  int64_t src_start = 0;
  int64_t dst_start = 0;
  int64_t length = 0;
};

// Sets indices [dst_start, dst_start + length) of `dim` to `value`.
struct SliceFill {
  int dim = 0;
  int64_t dst_start = 0;
  int64_t length = 0;
  double value = 0;
};

struct TensorPlan {
  int layer_index = 0;   // into LogicalCheckpoint::layers
  int tensor_index = 0;  // into that layer's tensors
  std::vector<int64_t> shape;  // the target shard's shape
  bool average = false;  // element-wise mean of all source replicas (no copies)
  std::vector<SliceCopy> copies;
  std::vector<SliceFill> fills;
  int64_t numel() const;
};

// One target layer_NN-model_TT-model_states.pt.
struct LayerFilePlan {
  std::string name;
  int layer_index = 0;  // into LogicalCheckpoint::layers
  int tp_rank = 0;
  std::vector<TensorPlan> tensors;  // in the source file's key order
  int64_t bytes = 0;                // tensor bytes to write
};

// A parameter name and its target shard shape, as `param_shapes` records it.
using ParamShape = std::pair<std::string, std::vector<int64_t>>;

// One target mp_rank_XX_model_states.pt.
struct ModelStatesPlan {
  std::string name;
  int pp_rank = 0, tp_rank = 0;
  int source_mp = 0;  // source mp_rank file whose metadata and RNG state are copied
  std::vector<std::vector<ParamShape>> param_shapes;  // per optimizer group
  std::vector<std::string> buffer_names;
};

struct PlanOptions {
  int tp = 1, pp = 1, dp = 0;  // dp 0 = keep the source's
  std::vector<int> layers_per_stage;
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  std::optional<int64_t> vocab_size;
  double vocab_pad_value = 0;
  bool optimizer = false;  // also write optimizer shards (one per target rank)
};

struct Plan {
  int tp = 1, pp = 1, dp = 1;
  int64_t padded_vocab = 0;     // target rows of vocabulary tensors (0: none)
  std::vector<int> stage_bounds;  // stage p owns specs [b[p], b[p+1])
  std::vector<LayerFilePlan> layer_files;
  std::vector<ModelStatesPlan> model_states;
  bool optimizer = false;          // optimizer shards for every (pp, tp, dp) rank
  std::vector<std::string> notes;  // merges, fills and other things to tell the user

  int64_t TensorBytes() const;
  // A readable listing (notes excluded); `detail` adds every slice of every tensor.
  std::string ToString(const LogicalCheckpoint& src, bool detail) const;
};

// The effective drift policy of a replicated tensor.
ReplicatedPolicy PolicyFor(const ParamRule& rule, ReplicatedPolicy command_line);

Result<Plan> MakePlan(const LogicalCheckpoint& src, const PlanOptions& options);

// The whole logical tensor (TP 1, replicas merged by `replicated`, source
// padding kept), for comparing checkpoints of different layouts.
TensorPlan PlanFullTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index,
                          ReplicatedPolicy replicated);

}  // namespace reshard
