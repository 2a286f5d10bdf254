// Building one target tensor's bytes from its plan.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/plan.h"

namespace reshard {

// Fills `out` with the target tensor `plan` describes: copies from the shards
// of `t` (memory-mapped weights, or gathered optimizer state), fills, or the
// mean of the replicas. Returns the number of source bytes read.
int64_t MaterializeTensor(const LogicalTensor& t, const TensorPlan& plan, std::vector<uint8_t>* out);

// The same into `dst`, which holds plan.numel() elements of t.dtype. Every
// element is written (a plan covers its whole target).
int64_t MaterializeInto(const LogicalTensor& t, const TensorPlan& plan, uint8_t* dst);

}  // namespace reshard
