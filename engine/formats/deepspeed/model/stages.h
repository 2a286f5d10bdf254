// Pipeline stages of the target layout: which specs each stage owns, and the
// parameter names and shapes DeepSpeed records per stage (`param_shapes`,
// `buffer_names`).
#pragma once

#include <string>
#include <vector>

#include "formats/deepspeed/model/flat_group.h"
#include "logical/optimizer_groups.h"
#include "logical/logical_checkpoint.h"
#include "plan/tensor_plan.h"

namespace reshard {

// The partition method the checkpoint records (the rule set says where), or
// the rule set's default: "uniform", "parameters" or "type:<regex>".
std::string PartitionMethod(const LogicalCheckpoint& src);

// Stage bounds for `pp` stages: from `layers_per_stage` when given, else by
// the partition method recorded in the checkpoint (the rule set says where).
// Every stage must own at least one transformer block. `ep`: the target's
// expert-parallel size, whose ranks each build E/EP experts of a MoE layer
// (what DeepSpeed's `parameters` method counts).
Result<std::vector<int>> TargetStageBounds(const LogicalCheckpoint& src, int pp, int tp,
                                           int64_t padded_vocab,
                                           const std::vector<int>& layers_per_stage, int ep = 1);

struct StageParameters {
  std::vector<std::vector<ParamShape>> groups;  // optimizer param groups, in order
  std::vector<std::string> buffers;             // persistent buffer names
};

// Parameters of stage [begin, end) in DeepSpeed's named_parameters() order:
// the tied module first (`tied_modules.<m>.<key>`), then `<spec id>.<key>`,
// grouped the way the rule set's optimizer_groups says.
StageParameters StageParams(const LogicalCheckpoint& src, int begin, int end, int tp,
                            int64_t padded_vocab);

// The `param_shapes` an mp_rank file records, as (name, shape) groups; false
// when it has none or they are malformed (a negative dim, or a count of a
// shape or a group above kMaxElements).
bool ReadParamShapes(const Value& metadata, std::vector<std::vector<ParamShape>>* out);

// The optimizer's name of a layer tensor: tied_modules.<m>.<key> for the tied
// embedding, <spec id>.<key> otherwise.
std::string ParamName(const LogicalCheckpoint& src, int layer_index, int tensor_index);

// The layer and tensor a parameter name from `param_shapes` or
// `param_slice_mappings` refers to; false for a name the checkpoint lacks.
bool ResolveParamName(const LogicalCheckpoint& src, const std::string& name, int* layer_index,
                      int* tensor_index);

}  // namespace reshard
