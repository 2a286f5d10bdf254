#include "container/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "container/kernel_copy.h"
#include "container/write_fully.h"
#include "util/shape.h"

namespace reshard {
namespace {

std::string ShapeJson(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

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

namespace {

// The JSON header, padded.
Result<std::string> Header(const std::vector<SafetensorsTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  int64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const char* dtype = SafetensorsDTypeName(t.dtype);
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

}  // namespace

Result<SafetensorsLayout> LayOutSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  RESHARD_ASSIGN_OR_RETURN(std::string header, Header(tensors, metadata));
  SafetensorsLayout layout;
  for (int i = 0; i < 8; ++i) layout.prefix += static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  layout.prefix += header;
  layout.size = static_cast<int64_t>(layout.prefix.size());
  for (const SafetensorsTensor& t : tensors) {
    layout.offsets.push_back(layout.size);
    layout.size += SafetensorsBytes(t);
  }
  return layout;
}

std::vector<int64_t> SafetensorsCuts(const SafetensorsLayout& layout,
                                     const std::vector<SafetensorsTensor>& tensors, int64_t part_bytes) {
  std::vector<int64_t> cuts = {0};
  size_t t = 0;  // the tensor the next cut falls in
  for (int64_t at = part_bytes; at < layout.size; at += part_bytes) {
    while (t + 1 < tensors.size() && layout.offsets[t + 1] <= at) ++t;
    int64_t cut = at;
    if (!tensors.empty() && at >= layout.offsets[t]) {
      const int es = ElementSize(tensors[t].dtype);
      cut = layout.offsets[t] + (at - layout.offsets[t]) / es * es;
    }
    if (cut > cuts.back()) cuts.push_back(cut);
  }
  cuts.push_back(layout.size);
  return cuts;
}

Result<FileDigest> WriteSafetensorsRange(const std::string& path, const SafetensorsLayout& layout,
                                         const std::vector<SafetensorsTensor>& tensors, int64_t begin,
                                         int64_t end, std::vector<uint8_t>* buffer,
                                         const std::function<void(int64_t)>& written) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return WriteError(path, errno);
  FileCloser closer(fd);
  FileDigest piece{0, 0, begin};
  auto put = [&](const uint8_t* data, int64_t n, const FileSpans& spans) -> Status {
    if (int err = WriteProduced(fd, data, static_cast<size_t>(n), begin + piece.bytes, spans)) {
      return WriteError(path, err);
    }
    piece.crc32 = ProducedCrc(piece.crc32, data, static_cast<size_t>(n), spans);
    piece.bytes += n;
    return Status::Ok();
  };
  const int64_t prefix = static_cast<int64_t>(layout.prefix.size());
  if (begin < prefix) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(layout.prefix.data());
    RESHARD_RETURN_IF_ERROR(put(bytes + begin, std::min(end, prefix) - begin, {}));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& t = tensors[i];
    const int64_t from = std::max(begin, layout.offsets[i]) - layout.offsets[i];
    const int64_t to = std::min(end, layout.offsets[i] + SafetensorsBytes(t)) - layout.offsets[i];
    const int es = ElementSize(t.dtype);
    if (from >= to) continue;
    if (from % es != 0 || to % es != 0) {
      return Status::Internal(path + ": a range cuts an element of " + t.name);
    }
    // Whole elements per piece, so producers that convert values see whole ones.
    const int64_t step = std::max<int64_t>(es, static_cast<int64_t>(buffer->size()) / es * es);
    if (buffer->size() < static_cast<size_t>(step)) buffer->resize(step);
    FileSpans spans;
    for (int64_t done = from; done < to;) {
      const int64_t n = std::min(step, to - done);
      spans.clear();
      RESHARD_RETURN_IF_ERROR(t.produce(done, n, buffer->data(), SpanSink(&spans, buffer->data(), n)));
      RESHARD_RETURN_IF_ERROR(put(buffer->data(), n, spans));
      if (written) written(n);
      done += n;
    }
  }
  return piece;
}

}  // namespace reshard
