// The fixed numbers of the zip format (APPNOTE.TXT) that both the writer and
// the reader's checks use: record signatures, fixed record sizes, the ZIP64
// extra field's id and the field limits past which ZIP64 takes over.
#pragma once

#include <cstdint>

namespace reshard {

constexpr uint32_t kZipLocalSignature = 0x04034b50;
constexpr uint32_t kZipCentralSignature = 0x02014b50;
constexpr uint32_t kZipEndSignature = 0x06054b50;
constexpr uint32_t kZip64EndSignature = 0x06064b50;
constexpr uint32_t kZip64LocatorSignature = 0x07064b50;
constexpr uint64_t kZipLocalSize = 30;  // a local header before its name and extra field
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint64_t kZipMax16 = 0xFFFF;
constexpr uint64_t kZipMax32 = 0xFFFFFFFF;  // also what a field moved to ZIP64 holds

}  // namespace reshard
