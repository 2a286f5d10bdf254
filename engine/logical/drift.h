// Drift between the TP-replicated copies of a tensor.
//
// Megatron keeps norms, row-parallel biases and position embeddings on every
// TP rank and relies on identical updates to keep them equal; in bf16
// training they drift apart. Before merging replicas reshard measures how far
// each copy is from TP rank 0's.
#pragma once

#include <string>
#include <vector>

#include "logical/logical_checkpoint.h"

namespace reshard {

struct Drift {
  int layer_index = 0;
  int tensor_index = 0;
  double max_abs_diff = 0;   // largest |replica - rank 0| over all elements and ranks
  int64_t elements_differing = 0;
  int worst_rank = 0;        // the rank holding the largest difference
};

// Drift of every replicated tensor whose copies are not bit-identical, largest
// first. Reads the replicated tensors' data (norms and biases: small).
std::vector<Drift> MeasureDrift(const LogicalCheckpoint& ckpt);

// "layer_03/input_layernorm.weight: max |diff| 0.0039 (TP rank 1), 12 elements differ"
std::string DescribeDrift(const LogicalCheckpoint& ckpt, const Drift& d);

}  // namespace reshard
