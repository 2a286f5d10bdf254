// Safetensors files, written natively: an 8-byte little-endian header length,
// a JSON header naming each tensor's dtype, shape and byte range, then the
// tensors' bytes back to back in header order. Each tensor is streamed from
// its producer a buffer at a time, so a file of any size costs one buffer.
// The layout is known before any byte is written, so a big file can also be
// written as byte ranges by several workers at once.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "pickle/dtype.h"
#include "reshard/status.h"
#include "util/byte_producer.h"
#include "util/crc32.h"

namespace reshard {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  ByteProducer produce;  // the tensor's bytes, row-major, little-endian
};

// The bytes of `t` (numel x element size).
int64_t SafetensorsBytes(const SafetensorsTensor& t);

// Where everything lies in the file. The header is JSON, padded with spaces
// to a multiple of 8 bytes: tensors in order, then `metadata` under
// "__metadata__". An error for a dtype safetensors has no name for (complex).
struct SafetensorsLayout {
  std::string prefix;            // the 8 length bytes and the header
  std::vector<int64_t> offsets;  // each tensor's first byte in the file
  int64_t size = 0;              // of the file
};

Result<SafetensorsLayout> LayOutSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                            const std::map<std::string, std::string>& metadata);

// Cuts the file into ranges of about `part_bytes` (at least one): the
// returned offsets run from 0 to the file size, each at a whole element of
// the tensor it falls in, so that producers which convert values see whole
// ones.
std::vector<int64_t> SafetensorsCuts(const SafetensorsLayout& layout,
                                     const std::vector<SafetensorsTensor>& tensors, int64_t part_bytes);

// Writes bytes [begin, end) of the file at `path`, creating it if absent and
// never truncating it, through `buffer` (its size is the write size);
// `written` (may be empty) is told the tensor bytes as they are written.
// Returns the range's digest (offset `begin`).
Result<FileDigest> WriteSafetensorsRange(const std::string& path, const SafetensorsLayout& layout,
                                         const std::vector<SafetensorsTensor>& tensors, int64_t begin,
                                         int64_t end, std::vector<uint8_t>* buffer,
                                         const std::function<void(int64_t)>& written);

// `s` as a JSON string literal, quotes included.
std::string JsonString(const std::string& s);

}  // namespace reshard
