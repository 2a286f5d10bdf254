// Pipeline stage partitioning, as DeepSpeed's PipelineModule computes it.
//
// A writer of pipeline checkpoints must put every layer on the stage the
// target DeepSpeed will put it on, because optimizer shards and
// `param_shapes` are per stage. These functions reproduce DeepSpeed's
// current algorithms (partition_uniform with the remainder on the first
// stages, and the dynamic-programming partition_balanced); the result is the
// list of stage bounds: stage p owns specs [parts[p], parts[p+1]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

std::vector<int> PartitionUniform(int num_items, int num_parts);

// Splits `weights` into `num_parts` contiguous runs minimising the spread
// between the heaviest and the lightest run.
std::vector<int> PartitionBalanced(const std::vector<int64_t>& weights, int num_parts);

// One spec of the pipeline: the class name type:<regex> methods match, and
// its trainable parameter count (for the `parameters` method).
struct SpecWeight {
  std::string class_name;
  int64_t num_params = 0;
};

// Applies a DeepSpeed partition method: "uniform", "parameters" or
// "type:<regex>" (case-insensitive search on class names).
Result<std::vector<int>> PartitionStages(const std::string& method,
                                         const std::vector<SpecWeight>& specs, int num_stages);

}  // namespace reshard
