#include "container/zip_records.h"

namespace reshard {
namespace {

constexpr uint16_t kUtf8Names = 1 << 11;       // general purpose flag, as PyTorch sets it
constexpr uint16_t kDataDescriptor = 1 << 3;   // CRC and sizes follow the data
constexpr uint16_t kVersion20 = 20;            // "version needed": stored files
constexpr uint16_t kVersion45 = 45;            // ... with ZIP64 fields
constexpr uint32_t kDescriptorSignature = 0x08074b50;
constexpr uint64_t kAlignment = 64;            // of record data, as in PyTorch

// Appends the `bytes` low bytes of `value`, little-endian (zip's byte order).
void Put(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

bool Zip64(uint64_t value, const ZipStyle& style) { return value >= style.zip64_threshold; }

uint16_t Flags(const ZipStyle& style) {
  return style.data_descriptors ? kUtf8Names | kDataDescriptor : kUtf8Names;
}

}  // namespace

std::string ZipLocalHeader(const ZipEntry& entry, const ZipStyle& style) {
  const bool zip64 = Zip64(entry.size, style);
  const uint64_t zip64_extra = zip64 ? 4 + 16 : 0;
  const uint64_t unpadded = entry.offset + kZipLocalSize + entry.name.size() + zip64_extra + 4;
  const uint64_t padding = (kAlignment - unpadded % kAlignment) % kAlignment;
  // With data descriptors the header knows nothing of the data: its fields,
  // and the ZIP64 field's (whose presence makes the descriptor's sizes 8
  // bytes), are zero.
  const uint64_t size = style.data_descriptors ? 0 : entry.size;

  std::string header;
  Put(&header, kZipLocalSignature, 4);
  Put(&header, zip64 ? kVersion45 : kVersion20, 2);
  Put(&header, Flags(style), 2);
  Put(&header, 0, 2);  // method: stored
  Put(&header, 0, 4);  // time and date: none, for reproducible files
  Put(&header, style.data_descriptors ? 0 : entry.crc, 4);
  Put(&header, zip64 && !style.data_descriptors ? kZipMax32 : size, 4);  // compressed size
  Put(&header, zip64 && !style.data_descriptors ? kZipMax32 : size, 4);  // uncompressed size
  Put(&header, entry.name.size(), 2);
  Put(&header, zip64_extra + 4 + padding, 2);
  header += entry.name;
  if (zip64) {
    Put(&header, kZip64ExtraId, 2);
    Put(&header, 16, 2);
    Put(&header, size, 8);  // uncompressed
    Put(&header, size, 8);  // compressed
  }
  header += "FB";
  Put(&header, padding, 2);
  header.append(padding, 'Z');
  return header;
}

std::string ZipDataDescriptor(const ZipEntry& entry, const ZipStyle& style) {
  std::string descriptor;
  if (!style.data_descriptors) return descriptor;
  const int width = Zip64(entry.size, style) ? 8 : 4;
  Put(&descriptor, kDescriptorSignature, 4);
  Put(&descriptor, entry.crc, 4);
  Put(&descriptor, entry.size, width);  // compressed
  Put(&descriptor, entry.size, width);  // uncompressed
  return descriptor;
}

std::string ZipCentralHeader(const ZipEntry& entry, const ZipStyle& style) {
  const bool zip64_size = Zip64(entry.size, style);
  const bool zip64_offset = Zip64(entry.offset, style);
  // The ZIP64 field holds just the values whose 32-bit fields say kZipMax32.
  std::string zip64;
  if (zip64_size) {
    Put(&zip64, entry.size, 8);  // uncompressed
    Put(&zip64, entry.size, 8);  // compressed
  }
  if (zip64_offset) Put(&zip64, entry.offset, 8);
  const uint16_t version = zip64.empty() ? kVersion20 : kVersion45;

  std::string header;
  Put(&header, kZipCentralSignature, 4);
  Put(&header, version, 2);  // made by (MS-DOS: no file attributes)
  Put(&header, version, 2);  // needed to extract
  Put(&header, Flags(style), 2);
  Put(&header, 0, 2);  // method: stored
  Put(&header, 0, 4);  // time and date
  Put(&header, entry.crc, 4);
  Put(&header, zip64_size ? kZipMax32 : entry.size, 4);
  Put(&header, zip64_size ? kZipMax32 : entry.size, 4);
  Put(&header, entry.name.size(), 2);
  Put(&header, zip64.empty() ? 0 : 4 + zip64.size(), 2);
  Put(&header, 0, 2);  // comment length
  Put(&header, 0, 2);  // disk
  Put(&header, 0, 2);  // internal attributes
  Put(&header, 0, 4);  // external attributes
  Put(&header, zip64_offset ? kZipMax32 : entry.offset, 4);
  header += entry.name;
  if (!zip64.empty()) {
    Put(&header, kZip64ExtraId, 2);
    Put(&header, zip64.size(), 2);
    header += zip64;
  }
  return header;
}

std::string ZipEndRecords(uint64_t count, uint64_t offset, uint64_t size, const ZipStyle& style) {
  const bool zip64_count = count >= kZipMax16 || Zip64(count, style);
  const bool zip64_size = Zip64(size, style);
  const bool zip64_offset = Zip64(offset, style);
  std::string end;
  if (zip64_count || zip64_size || zip64_offset || style.data_descriptors) {
    const uint64_t record_offset = offset + size;
    Put(&end, kZip64EndSignature, 4);
    Put(&end, 44, 8);  // size of the rest of this record
    Put(&end, kVersion45, 2);
    Put(&end, kVersion45, 2);
    Put(&end, 0, 4);  // this disk
    Put(&end, 0, 4);  // the directory's disk
    Put(&end, count, 8);
    Put(&end, count, 8);
    Put(&end, size, 8);
    Put(&end, offset, 8);
    Put(&end, kZip64LocatorSignature, 4);
    Put(&end, 0, 4);  // disk of the record above
    Put(&end, record_offset, 8);
    Put(&end, 1, 4);  // disks
  }
  Put(&end, kZipEndSignature, 4);
  Put(&end, 0, 2);  // this disk
  Put(&end, 0, 2);  // the directory's disk
  Put(&end, zip64_count ? kZipMax16 : count, 2);
  Put(&end, zip64_count ? kZipMax16 : count, 2);
  Put(&end, zip64_size ? kZipMax32 : size, 4);
  Put(&end, zip64_offset ? kZipMax32 : offset, 4);
  Put(&end, 0, 2);  // comment length
  return end;
}

}  // namespace reshard
