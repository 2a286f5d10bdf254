// StateTensor: one parameter's optimizer state seen like its weight.
//
// Masters and moments are elementwise aligned with the parameter, so they
// have its rule, shapes and shards; only the dtype (fp32) and where the
// shards come from (flat optimizer partitions instead of layer files)
// differ. Locating them as a LogicalTensor lets every tensor plan made
// for the weight apply to its optimizer state unchanged.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "logical/logical_checkpoint.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "plan/tensor_plan.h"
#include "util/byte_producer.h"

namespace reshard {

struct StateTensor {
  LogicalTensor tensor;  // the weight's rule and shapes; fp32; shards in the flat partitions
  int layer_index = 0, tensor_index = 0;  // the weight's place in the checkpoint
};

// `state` (kMasterState, "exp_avg", ...) of parameter `name` from every
// source TP rank, located in the optimizer shards (nothing is copied).
Result<StateTensor> LocateState(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                const std::string& name, const std::string& state);

// A replicated parameter whose optimizer state differs between TP ranks.
struct StateDrift {
  std::string name;   // optimizer parameter name
  std::string state;  // kMasterState, "exp_avg", ...
  const ParamRule* rule = nullptr;
  int rank = 0;       // the first TP rank differing from rank 0
};

// True when two shards hold the same `n` elements of `element_size` bytes,
// read a block at a time (SourceShard::Copy), never mapped whole.
bool SameElements(const SourceShard& a, const SourceShard& b, int64_t n, int element_size);

// Every replicated parameter's state that is not bit-identical across TP ranks.
Result<std::vector<StateDrift>> MeasureStateDrift(const LogicalCheckpoint& src,
                                                  const SourceOptimizer& opt);

// The bytes of the weight `plan` describes, produced a range at a time:
// copied from `weight`'s shards, or — for an average of replicas with fp32
// masters in the optimizer state (`masters` not null) — the averaged master cast to the
// weight's dtype, so that weight == dtype(master) holds in the result as it
// does in DeepSpeed; for a source whose shards are the masters
// (src.weights_from_masters), the master cast. Adds the source bytes read to
// *read, which must outlive the producer.
Result<ByteProducer> WeightProducer(const LogicalCheckpoint& src, const SourceOptimizer* masters,
                                    const LogicalTensor& weight, const TensorPlan& plan,
                                    std::atomic<int64_t>* read);

}  // namespace reshard
