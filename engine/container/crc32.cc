#include "container/crc32.h"

#include <zlib.h>

namespace reshard {

// zlib's braided CRC: about 4 GB/s on the machine it was measured on
// (PyTorchStreamWriter, CRC included, managed 2.9 GB/s into a null sink).
uint32_t Crc32(uint32_t crc, const uint8_t* data, size_t n) {
  if (n == 0) return crc;  // zlib would answer a null `data` with 0
  return static_cast<uint32_t>(::crc32_z(crc, data, n));
}

uint32_t Crc32Combine(uint32_t first, uint32_t second, int64_t second_bytes) {
  return static_cast<uint32_t>(::crc32_combine(first, second, static_cast<z_off_t>(second_bytes)));
}

}  // namespace reshard
