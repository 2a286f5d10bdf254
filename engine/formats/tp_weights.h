// A model's weights cut for another tensor-parallel size
// (SourceCheckpoint::WeightsForTp), whatever format holds them: each target
// rank's tensors planned from the rules (plan/tensor_plan.h), the vocabulary
// re-padded for that TP; the source says where the bytes come from.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "formats/format.h"
#include "logical/logical_checkpoint.h"
#include "plan/tensor_plan.h"

namespace reshard {

// The bytes of the target rank tensor `plan` makes of tensor (layer_index,
// tensor_index): its weight (`state` ""), or that optimizer state of it.
using RankBytes = std::function<Result<ByteProducer>(int layer_index, int tensor_index, const TensorPlan& plan,
                                                     const std::string& state)>;

// Every weight of `ckpt` cut for `cut.tp` ranks as convert cuts layer files;
// with `cut.state`, that optimizer state of every parameter instead (fp32),
// and the weight of a buffer for the fp32 masters. `has_state`: the source
// carries optimizer state, without which a cut of a state is refused.
// `notes` learns what the re-padding did.
Result<TpWeights> CutWeights(const LogicalCheckpoint& ckpt, const TpCut& cut, bool has_state, const RankBytes& bytes,
                             std::vector<std::string>* notes);

}  // namespace reshard
