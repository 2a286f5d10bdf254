// The bytes of the zip records reshard writes, for stored (uncompressed)
// entries: local headers, data descriptors, central directory headers and
// the end records. ZipWriter (zip_writer.h) writes whole torch.save files
// with them and the Distributed Checkpoint writer (dcp_writer.h) the
// archives inside a `.distcp` file, whose every byte it places before
// writing any: each encoding's length depends on sizes and offsets only,
// never on a CRC.
//
// Every record's data starts on a multiple of 64 bytes from the archive's
// first byte, as PyTorch aligns it: the local header's "FB" extra field is
// padded with 'Z'. Timestamps are zero, so the output is deterministic.
#pragma once

#include <cstdint>
#include <string>

#include "container/zip_format.h"

namespace reshard {

// One record of an archive being written.
struct ZipEntry {
  std::string name;     // with the archive folder
  uint64_t offset = 0;  // of its local header, from the archive's first byte
  uint64_t size = 0;    // of its data
  uint32_t crc = 0;     // of its data
};

struct ZipStyle {
  // Sizes, offsets and counts at or above this are written as ZIP64 fields.
  // Only tests lower it, to get ZIP64 archives without writing 4 GiB.
  uint64_t zip64_threshold = kZipMax32;
  // torch 2.x's layout: a local header holds no CRC nor sizes (flag bit 3),
  // a data descriptor after the data gives them, and the end records always
  // include ZIP64's. Without it (PyTorch 1.13's layout) the local header
  // holds the sizes, and the CRC is patched in after the data.
  bool data_descriptors = false;
};

// Where a local header holds the CRC (for patching it).
constexpr uint64_t kZipLocalCrcOffset = 14;

// The local header of `entry`, padded so that its data is aligned.
std::string ZipLocalHeader(const ZipEntry& entry, const ZipStyle& style);

// What follows the data with `data_descriptors`: the CRC and the sizes,
// 8-byte sizes when they are ZIP64's. Empty without.
std::string ZipDataDescriptor(const ZipEntry& entry, const ZipStyle& style);

std::string ZipCentralHeader(const ZipEntry& entry, const ZipStyle& style);

// The end records of a central directory of `count` entries, `size` bytes at
// `offset`.
std::string ZipEndRecords(uint64_t count, uint64_t offset, uint64_t size, const ZipStyle& style);

}  // namespace reshard
