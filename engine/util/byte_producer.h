// ByteProducer: bytes made on demand, a range at a time.
//
// Large tensors are never built whole: a writer asks for one buffer-sized
// range after another, so memory stays bounded by the buffer, whatever the
// tensor's size.
#pragma once

#include <cstdint>
#include <functional>

#include "reshard/status.h"

namespace reshard {

// Writes bytes [offset, offset + length) of the product into `dst`.
using ByteProducer = std::function<Status(int64_t offset, int64_t length, uint8_t* dst)>;

}  // namespace reshard
