// Crc32: the zip (IEEE 802.3) CRC-32, for the records reshard writes and for
// checking the records it reads (`lint --deep`).
#pragma once

#include <cstddef>
#include <cstdint>

namespace reshard {

// The CRC-32 of [data, data + n) continued from `crc`: Crc32(0, ...) starts
// a new one, and Crc32(Crc32(0, a), b) is that of a then b.
uint32_t Crc32(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace reshard
