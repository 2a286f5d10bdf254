// StateTensor: one parameter's optimizer state seen like its weight.
//
// Masters and moments are elementwise aligned with the parameter, so they
// have its rule, shapes and shards; only the dtype (fp32) and where the
// shards come from (flat optimizer partitions instead of layer files)
// differ. Gathering them into a LogicalTensor lets every tensor plan made
// for the weight apply to its optimizer state unchanged.
#pragma once

#include <string>
#include <vector>

#include "logical/logical_checkpoint.h"
#include "optim/source_optimizer.h"

namespace reshard {

class StateTensor {
 public:
  // `state` (kMasterState, "exp_avg", ...) of parameter `name`, from every source TP rank.
  static Result<StateTensor> Gather(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                    const std::string& name, const std::string& state);

  StateTensor(StateTensor&&) = default;
  StateTensor(const StateTensor&) = delete;
  StateTensor& operator=(const StateTensor&) = delete;

  const LogicalTensor& tensor() const { return tensor_; }
  int layer_index() const { return layer_index_; }
  int tensor_index() const { return tensor_index_; }

 private:
  StateTensor() = default;
  LogicalTensor tensor_;        // shards point into shards_
  std::vector<Tensor> shards_;  // own their gathered bytes
  int layer_index_ = 0, tensor_index_ = 0;
};

}  // namespace reshard
