// The bytes of planned tensors made into reshard::TensorBytes, and pickled
// trees into TreeValues: what reshard::Checkpoint hands its callers.
#pragma once

#include <cstdint>
#include <vector>

#include "pickle/value.h"
#include "reshard/checkpoint.h"
#include "util/byte_producer.h"

namespace reshard {

// The tensor `produce` makes, of `dtype` and `shape`: a private
// copy-on-write mapping of the source file where the product lies whole in
// one (ByteProducer::in_place), else a buffer of its own filled by it. Then
// the CRC-32 of every record read whole is checked (a damaged one refuses).
Result<TensorBytes> MakeTensorBytes(DType dtype, const std::vector<int64_t>& shape, const ByteProducer& produce);

// The tree `v` as plain data, each tensor made as MakeTensorBytes makes it
// (a contiguous tensor of the tree; a strided view of a storage is refused).
// Ordered dicts become dicts and torch.Size a tuple; other objects keep
// their class, arguments and state.
Result<TreeValue> MakeTreeValue(const Value& v);

}  // namespace reshard
