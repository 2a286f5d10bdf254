#include "container/safetensors_reader.h"

#include <algorithm>
#include <string_view>

#include "container/json_reader.h"
#include "container/mapped_file.h"
#include "util/shape.h"

namespace reshard {
namespace {

// safetensors' own limit on the header; more is a damaged or hostile file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct Entry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range in the data after the header
};

bool ReadPair(const Value& v, int64_t* a, int64_t* b) {
  std::vector<int64_t> pair;
  if (!ReadIntSequence(v, &pair) || pair.size() != 2) return false;
  *a = pair[0];
  *b = pair[1];
  return true;
}

// One header entry, checked on its own: a known dtype, a shape, and a byte
// range of exactly the shape's bytes inside the `data_bytes` after the header.
Result<Entry> ReadEntry(const std::string& name, const Value& v, int64_t data_bytes, const std::string& path) {
  auto bad = [&](const std::string& problem) {
    return Status::InvalidInput(path + ": tensor '" + name + "' " + problem + "; the file is damaged or is not "
                                "a safetensors file");
  };
  const Value* dtype = Find(v, "dtype");
  const Value* shape = Find(v, "shape");
  const Value* offsets = Find(v, "data_offsets");
  if (dtype == nullptr || shape == nullptr || offsets == nullptr || !dtype->is(Value::Kind::kString)) {
    return bad("lacks dtype, shape or data_offsets in the header");
  }
  Entry e;
  e.name = name;
  std::optional<DType> known = DTypeFromSafetensorsName(dtype->as_string());
  if (!known) return bad("has dtype " + dtype->as_string() + ", which reshard does not read");
  e.dtype = *known;
  if (!shape->is(Value::Kind::kList) || !ReadIntSequence(*shape, &e.shape)) return bad("has a shape that is not a list of integers");
  const int64_t numel = CheckedShapeNumel(e.shape);
  if (numel < 0) return bad("has an impossible shape");
  if (!ReadPair(*offsets, &e.begin, &e.end) || e.begin < 0 || e.end < e.begin || e.end > data_bytes) {
    return bad("has data_offsets outside the file's " + std::to_string(data_bytes) + " data bytes");
  }
  if (e.end - e.begin != numel * ElementSize(e.dtype)) {
    return bad("holds " + std::to_string(e.end - e.begin) + " bytes, but its shape and dtype need " +
               std::to_string(numel * ElementSize(e.dtype)));
  }
  return e;
}

// REQUIRES: `entries` sorted by range. Empty tensors share no bytes.
Status CheckNoOverlap(const std::vector<Entry>& entries, const std::string& path) {
  const Entry* last = nullptr;  // the non-empty tensor ending last so far
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (last != nullptr && e.begin < last->end) {
      return Status::InvalidInput(path + ": tensors '" + last->name + "' and '" + e.name +
                                  "' share bytes; the file is damaged or is not a safetensors file");
    }
    if (last == nullptr || e.end > last->end) last = &e;
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsFile> ReadSafetensors(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  const FileWindow whole = file->whole();
  return ReadSafetensors(std::move(file), whole);
}

Result<SafetensorsFile> ReadSafetensors(std::shared_ptr<const MappedFile> file, const FileWindow& window) {
  RESHARD_RETURN_IF_ERROR(file->CheckWindow(window));
  const std::string path = file->Name(window);
  const uint8_t* start = file->data() + window.offset;
  const uint64_t size = window.size;
  uint64_t header_bytes = 0;
  if (size >= 8) {
    FetchExactly(start, 8);
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | start[i];
  }
  if (size < 8 || header_bytes > kMaxHeaderBytes || header_bytes > size - 8) {
    return Status::InvalidInput(path + " is not a safetensors file (its first 8 bytes are not the length of a "
                                "header inside the file)");
  }
  FetchExactly(start + 8, header_bytes);
  const std::string_view text(reinterpret_cast<const char*>(start + 8), header_bytes);
  RESHARD_ASSIGN_OR_RETURN(Value header, ParseJson(text, path + "'s header"));
  const Items* items = header.is(Value::Kind::kDict) ? DictItems(header) : nullptr;
  if (items == nullptr) return Status::InvalidInput(path + "'s header is not a JSON object; it is not a safetensors file");
  const int64_t data_bytes = static_cast<int64_t>(size - 8 - header_bytes);
  SafetensorsFile out;
  std::vector<Entry> entries;
  for (const auto& [key, v] : *items) {
    if (key.as_string() == "__metadata__") {
      out.metadata = v;
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(Entry e, ReadEntry(key.as_string(), v, data_bytes, path));
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  RESHARD_RETURN_IF_ERROR(CheckNoOverlap(entries, path));
  const uint8_t* data = start + 8 + header_bytes;
  for (const Entry& e : entries) {
    ByteView bytes{file, data + e.begin, static_cast<size_t>(e.end - e.begin), /*mapped=*/true};
    out.tensors.emplace_back(e.name, MakeTensorOver(e.dtype, e.shape, std::move(bytes)));
  }
  return out;
}

}  // namespace reshard
