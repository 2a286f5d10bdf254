// Crc32: the zip (IEEE 802.3) CRC-32, for the records reshard writes and for
// checking the records it reads (`lint --deep`).
#pragma once

#include <cstddef>
#include <cstdint>

namespace reshard {

// The CRC-32 of [data, data + n) continued from `crc`: Crc32(0, ...) starts
// a new one, and Crc32(Crc32(0, a), b) is that of a then b.
uint32_t Crc32(uint32_t crc, const uint8_t* data, size_t n);

// A file as it was written: its size and CRC-32, computed from the bytes
// on their way out (for the output's manifest). A file written in pieces by
// several jobs reports one digest per piece, each at its offset.
struct FileDigest {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
  int64_t offset = 0;  // of the piece's first byte; 0 for a whole file
};

// The CRC-32 of a then b, from Crc32(0, a), Crc32(0, b) and b's length: the
// CRC of a file whose parts were not checksummed in file order.
uint32_t Crc32Combine(uint32_t first, uint32_t second, int64_t second_bytes);

}  // namespace reshard
