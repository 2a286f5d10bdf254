#include "container/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "container/write_fully.h"
#include "util/shape.h"

namespace reshard {
namespace {

// The safetensors name of `dtype`; null when it has none.
const char* SafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return "F64";
    case DType::kFloat32: return "F32";
    case DType::kFloat16: return "F16";
    case DType::kBFloat16: return "BF16";
    case DType::kInt64: return "I64";
    case DType::kInt32: return "I32";
    case DType::kInt16: return "I16";
    case DType::kInt8: return "I8";
    case DType::kUInt8: return "U8";
    case DType::kBool: return "BOOL";
    case DType::kComplex64:
    case DType::kComplex128: return nullptr;
  }
  return nullptr;
}

std::string ShapeJson(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

// Closes the descriptor however the write ends.
class FileCloser {
 public:
  explicit FileCloser(int fd) : fd_(fd) {}
  ~FileCloser() { ::close(fd_); }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;

 private:
  int fd_;
};

Status WriteError(const std::string& path, int err) {
  return Status::IoError("cannot write " + path + ": " + std::strerror(err));
}

}  // namespace

int64_t SafetensorsBytes(const SafetensorsTensor& t) { return ShapeNumel(t.shape) * ElementSize(t.dtype); }

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

Result<std::string> SafetensorsHeader(const std::vector<SafetensorsTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  int64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const char* dtype = SafetensorsDType(t.dtype);
    if (dtype == nullptr) {
      return Status::Unsupported(t.name + " is " + DTypeName(t.dtype) + ", which safetensors cannot hold");
    }
    const int64_t end = offset + SafetensorsBytes(t);
    json += (json.size() > 1 ? "," : "") + JsonString(t.name) + ":{\"dtype\":\"" + dtype +
            "\",\"shape\":" + ShapeJson(t.shape) + ",\"data_offsets\":[" + std::to_string(offset) +
            "," + std::to_string(end) + "]}";
    offset = end;
  }
  if (!metadata.empty()) {
    json += std::string(json.size() > 1 ? "," : "") + "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      json += (first ? "" : ",") + JsonString(key) + ":" + JsonString(value);
      first = false;
    }
    json += "}";
  }
  json += "}";
  // The data starts 8-byte aligned, as other writers do, so readers that map
  // the file can view tensors in place.
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');
  return json;
}

Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata,
                        std::vector<uint8_t>* buffer, const std::function<void(int64_t)>& written,
                        FileDigest* digest) {
  RESHARD_ASSIGN_OR_RETURN(std::string header, SafetensorsHeader(tensors, metadata));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return WriteError(path, errno);
  FileCloser closer(fd);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  if (int err = WriteFully(fd, length, sizeof(length))) return WriteError(path, err);
  const uint8_t* header_bytes = reinterpret_cast<const uint8_t*>(header.data());
  if (int err = WriteFully(fd, header_bytes, header.size())) return WriteError(path, err);
  FileDigest file{static_cast<int64_t>(sizeof(length) + header.size()),
                  Crc32(Crc32(0, length, sizeof(length)), header_bytes, header.size())};
  for (const SafetensorsTensor& t : tensors) {
    const int64_t bytes = SafetensorsBytes(t);
    const int es = ElementSize(t.dtype);
    // Whole elements per piece, so producers that convert values see whole ones.
    const int64_t piece = std::max<int64_t>(es, static_cast<int64_t>(buffer->size()) / es * es);
    if (buffer->size() < static_cast<size_t>(piece)) buffer->resize(piece);
    for (int64_t done = 0; done < bytes;) {
      const int64_t n = std::min(piece, bytes - done);
      RESHARD_RETURN_IF_ERROR(t.produce(done, n, buffer->data()));
      if (int err = WriteFully(fd, buffer->data(), static_cast<size_t>(n))) return WriteError(path, err);
      file.crc32 = Crc32(file.crc32, buffer->data(), static_cast<size_t>(n));
      file.bytes += n;
      if (written) written(n);
      done += n;
    }
  }
  if (digest != nullptr) *digest = file;
  return Status::Ok();
}

}  // namespace reshard
