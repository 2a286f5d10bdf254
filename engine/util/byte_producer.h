// ByteProducer: bytes made on demand, a range at a time.
//
// Large tensors are never built whole: a writer asks for one buffer-sized
// range after another, so memory stays bounded by the buffer, whatever the
// tensor's size.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "reshard/status.h"

namespace reshard {

// Writes bytes [offset, offset + length) of the product into `dst`.
using ByteProducer = std::function<Status(int64_t offset, int64_t length, uint8_t* dst)>;

// The bytes of `from` from byte `begin` on: a piece of a bigger product.
inline ByteProducer BytesFrom(ByteProducer from, int64_t begin) {
  return [from = std::move(from), begin](int64_t offset, int64_t length, uint8_t* dst) {
    return from(begin + offset, length, dst);
  };
}

}  // namespace reshard
