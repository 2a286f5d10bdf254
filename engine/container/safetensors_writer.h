// Safetensors files, written natively: an 8-byte little-endian header length,
// a JSON header naming each tensor's dtype, shape and byte range, then the
// tensors' bytes back to back in header order. Each tensor is streamed from
// its producer a buffer at a time, so a file of any size costs one buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "container/crc32.h"
#include "pickle/dtype.h"
#include "reshard/status.h"
#include "util/byte_producer.h"

namespace reshard {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  ByteProducer produce;  // the tensor's bytes, row-major, little-endian
};

// The bytes of `t` (numel x element size).
int64_t SafetensorsBytes(const SafetensorsTensor& t);

// The header (JSON, padded with spaces to a multiple of 8 bytes): tensors in
// order, then `metadata` under "__metadata__". An error for a dtype
// safetensors has no name for (complex).
Result<std::string> SafetensorsHeader(const std::vector<SafetensorsTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata);

// Writes the file at `path` through `buffer` (its size is the write size);
// `written` (may be empty) is told the tensor bytes as they are written, and
// `digest` (may be null) set to the file's size and CRC-32.
Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata,
                        std::vector<uint8_t>* buffer, const std::function<void(int64_t)>& written,
                        FileDigest* digest = nullptr);

// `s` as a JSON string literal, quotes included.
std::string JsonString(const std::string& s);

}  // namespace reshard
