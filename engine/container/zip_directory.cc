#include "container/zip_directory.h"

#include <algorithm>
#include <initializer_list>

#include "container/zip_format.h"
#include "util/crc32.h"

namespace reshard {
namespace {

constexpr uint64_t kCentralSize = 46;
constexpr uint64_t kEndSize = 22;
constexpr uint64_t kZip64EndSize = 56;
constexpr uint64_t kZip64LocatorSize = 20;
constexpr uint64_t kEncrypted = 1;
constexpr uint64_t kDataDescriptor = 1 << 3;  // sizes and CRC follow the data

uint64_t Le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

// [offset, offset + n) lies inside [0, limit), without overflow.
bool Inside(uint64_t offset, uint64_t n, uint64_t limit) {
  return offset <= limit && n <= limit - offset;
}

// Replaces the fields that hold kZipMax32 by the values of the ZIP64 extra
// field in `extra`, which come in the order of `fields` (uncompressed size,
// compressed size, local header offset). False when they are not there.
bool ApplyZip64(const uint8_t* extra, uint64_t length, std::initializer_list<uint64_t*> fields) {
  bool needed = false;
  for (const uint64_t* f : fields) needed = needed || *f == kZipMax32;
  if (!needed) return true;
  for (uint64_t at = 0; at + 4 <= length;) {
    const uint64_t id = Le(extra + at, 2), n = Le(extra + at + 2, 2);
    if (!Inside(at + 4, n, length)) return false;
    if (id == kZip64ExtraId) {
      uint64_t used = 0;
      for (uint64_t* f : fields) {
        if (*f != kZipMax32) continue;
        if (!Inside(used, 8, n)) return false;
        *f = Le(extra + at + 4 + used, 8);
        used += 8;
      }
      return true;
    }
    at += 4 + n;
  }
  return false;
}

// Where the central directory is and how many entries it has.
struct End {
  uint64_t count = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t limit = 0;  // the directory ends before this (the end records)
};

// One central directory entry.
struct Entry {
  std::string name;
  uint64_t flags = 0, method = 0, crc = 0, compressed = 0, size = 0, local = 0;
};

class Parser {
 public:
  Parser(const MappedFile& file, const FileWindow& window)
      : name_(file.Name(window)), base_(window.offset), data_(file.data() + window.offset),
        size_(window.size) {}

  Status Run(std::string* archive, std::map<std::string, ZipRecord>* records) const;

 private:
  Status Error(const std::string& what) const {
    return Status::InvalidInput(name_ + ": " + what);
  }
  Status RecordError(const std::string& name, const std::string& what) const {
    return Error("zip record '" + name + "' " + what);
  }
  Status FindEnd(End* end) const;
  Status ReadZip64End(uint64_t end_at, End* end) const;
  Status ReadEntry(const End& end, uint64_t* at, Entry* entry) const;
  Status CheckEntry(const Entry& entry, const End& end, ZipRecord* record) const;

  const std::string name_;
  const uint64_t base_;  // the window's offset in the file
  const uint8_t* data_;  // the window's first byte
  const uint64_t size_;
};

// The end record is the last 22 bytes, or followed by a comment of the
// length it gives.
Status Parser::FindEnd(End* end) const {
  const Status damaged = Error(
      "no zip end record, so it is not a complete torch.save file; it is truncated or damaged");
  if (size_ < kEndSize) return damaged;
  const uint64_t lowest = size_ - kEndSize > kZipMax16 ? size_ - kEndSize - kZipMax16 : 0;
  FetchExactly(data_ + lowest, size_ - lowest);
  for (uint64_t at = size_ - kEndSize + 1; at-- > lowest;) {
    const uint8_t* p = data_ + at;
    if (Le(p, 4) != kZipEndSignature || at + kEndSize + Le(p + 20, 2) != size_) continue;
    if (Le(p + 4, 2) != 0 || Le(p + 6, 2) != 0 || Le(p + 8, 2) != Le(p + 10, 2)) {
      return Error("a zip archive split over several disks is not a torch.save file");
    }
    end->count = Le(p + 10, 2);
    end->size = Le(p + 12, 4);
    end->offset = Le(p + 16, 4);
    end->limit = at;
    if (end->count == kZipMax16 || end->size == kZipMax32 || end->offset == kZipMax32) {
      return ReadZip64End(at, end);
    }
    return Status::Ok();
  }
  return damaged;
}

// The ZIP64 end record, found through the locator just before the end record.
Status Parser::ReadZip64End(uint64_t end_at, End* end) const {
  const Status damaged = Error("its ZIP64 end record is missing or damaged");
  if (end_at < kZip64LocatorSize) return damaged;
  const uint8_t* locator = data_ + end_at - kZip64LocatorSize;
  if (Le(locator, 4) != kZip64LocatorSignature) return damaged;
  const uint64_t at = Le(locator + 8, 8);
  if (!Inside(at, kZip64EndSize, end_at - kZip64LocatorSize)) return damaged;
  const uint8_t* p = data_ + at;
  if (Le(p, 4) != kZip64EndSignature || Le(p + 24, 8) != Le(p + 32, 8)) return damaged;
  end->count = Le(p + 32, 8);
  end->size = Le(p + 40, 8);
  end->offset = Le(p + 48, 8);
  end->limit = at;
  return Status::Ok();
}

Status Parser::ReadEntry(const End& end, uint64_t* at, Entry* e) const {
  const uint64_t directory_end = end.offset + end.size;  // checked by Run
  const Status damaged = Error("its zip central directory is damaged");
  if (!Inside(*at, kCentralSize, directory_end)) return damaged;
  const uint8_t* p = data_ + *at;
  if (Le(p, 4) != kZipCentralSignature) return damaged;
  const uint64_t name_length = Le(p + 28, 2), extra_length = Le(p + 30, 2);
  const uint64_t length = kCentralSize + name_length + extra_length + Le(p + 32, 2);
  if (!Inside(*at, length, directory_end)) return damaged;
  e->flags = Le(p + 8, 2);
  e->method = Le(p + 10, 2);
  e->crc = Le(p + 16, 4);
  e->compressed = Le(p + 20, 4);
  e->size = Le(p + 24, 4);
  e->local = Le(p + 42, 4);
  e->name.assign(reinterpret_cast<const char*>(p + kCentralSize), name_length);
  const uint8_t* extra = p + kCentralSize + name_length;
  if (!ApplyZip64(extra, extra_length, {&e->size, &e->compressed, &e->local})) {
    return RecordError(e->name, "lacks the ZIP64 sizes its directory entry calls for; the file "
                                "is damaged");
  }
  *at += length;
  return Status::Ok();
}

// The entry's local header agrees with it and its data lies before the
// directory. torch.save's local headers leave the sizes and CRC to a data
// descriptor after the data (and hold zeros); reshard's give them.
Status Parser::CheckEntry(const Entry& e, const End& end, ZipRecord* record) const {
  if (e.flags & kEncrypted) return RecordError(e.name, "is encrypted, which torch.save never does");
  if (e.method != 0 || e.compressed != e.size) {
    return RecordError(e.name, "is compressed (method " + std::to_string(e.method) +
                                   "), but torch.save stores records uncompressed and reshard "
                                   "reads them in place; re-save the file with torch.save");
  }
  const Status mismatch = RecordError(e.name,
                                      "does not match its local header; the file is damaged or "
                                      "was not written by torch.save");
  if (!Inside(e.local, kZipLocalSize, end.offset)) return mismatch;
  const uint8_t* p = data_ + e.local;
  // With room for the name and torch.save's alignment padding, checked below.
  FetchExactly(p, static_cast<size_t>(std::min<uint64_t>(kZipLocalSize + 256, end.offset - e.local)));
  const uint64_t name_length = Le(p + 26, 2), extra_length = Le(p + 28, 2);
  const uint8_t* name = p + kZipLocalSize;
  if (Le(p, 4) != kZipLocalSignature ||
      !Inside(e.local + kZipLocalSize, name_length + extra_length, end.offset) ||
      std::string(reinterpret_cast<const char*>(name), name_length) != e.name ||
      Le(p + 8, 2) != e.method) {
    return mismatch;
  }
  uint64_t crc = Le(p + 14, 4), compressed = Le(p + 18, 4), size = Le(p + 22, 4);
  if (!ApplyZip64(name + name_length, extra_length, {&size, &compressed})) return mismatch;
  const bool described =
      (Le(p + 6, 2) & kDataDescriptor) && crc == 0 && compressed == 0 && size == 0;
  if (!described && (crc != e.crc || compressed != e.compressed || size != e.size)) {
    return mismatch;
  }
  record->data_offset = e.local + kZipLocalSize + name_length + extra_length;
  record->size = e.size;
  record->crc = static_cast<uint32_t>(e.crc);
  if (!Inside(record->data_offset, record->size, end.offset)) {
    return RecordError(e.name, "runs past the records' end (" + std::to_string(record->size) +
                                   " bytes at offset " + std::to_string(record->data_offset) +
                                   ", the zip directory at " + std::to_string(end.offset) +
                                   "); the file is truncated or damaged");
  }
  return Status::Ok();
}

Status Parser::Run(std::string* archive, std::map<std::string, ZipRecord>* records) const {
  End end;
  RESHARD_RETURN_IF_ERROR(FindEnd(&end));
  if (!Inside(end.offset, end.size, end.limit)) {
    return Error("its zip central directory lies outside the file; it is truncated or damaged");
  }
  FetchExactly(data_ + end.offset, end.limit - end.offset);
  uint64_t at = end.offset;
  for (uint64_t i = 0; i < end.count; ++i) {
    Entry entry;
    ZipRecord record;
    RESHARD_RETURN_IF_ERROR(ReadEntry(end, &at, &entry));
    RESHARD_RETURN_IF_ERROR(CheckEntry(entry, end, &record));
    if (i == 0) {
      const size_t slash = entry.name.find('/');
      if (slash == std::string::npos) {
        return RecordError(entry.name, "is not in an archive folder, as torch.save puts records");
      }
      *archive = entry.name.substr(0, slash + 1);
    }
    record.data_offset += base_;
    if (!records->emplace(entry.name, record).second) {
      return RecordError(entry.name, "appears twice in the zip directory; the file is damaged");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ZipDirectory> ZipDirectory::Read(const MappedFile& file, const FileWindow& window) {
  RESHARD_RETURN_IF_ERROR(file.CheckWindow(window));
  ZipDirectory directory;
  directory.window_ = window;
  RESHARD_RETURN_IF_ERROR(Parser(file, window).Run(&directory.archive_, &directory.records_));
  return directory;
}

const ZipRecord* ZipDirectory::Find(const std::string& name) const {
  auto it = records_.find(archive_ + name);
  return it == records_.end() ? nullptr : &it->second;
}

Status ZipDirectory::CheckCrcs(const MappedFile& file) const {
  // A view of the mapping that does not own it, for TouchedPages.
  const ByteView view{std::shared_ptr<const void>(std::shared_ptr<const void>(), &file), file.data(),
                      file.size(), /*mapped=*/true};
  constexpr uint64_t kPiece = 4 << 20;
  for (const auto& [name, record] : records_) {
    uint32_t crc = 0;
    for (uint64_t done = 0; done < record.size; done += kPiece) {
      const uint8_t* at = file.data() + record.data_offset + done;
      const size_t n = static_cast<size_t>(std::min(kPiece, record.size - done));
      crc = Crc32(crc, at, n);
      TouchedPages pages;
      pages.Note(view, at, n);
    }
    if (crc != record.crc) {
      return Status::InvalidInput(file.Name(window_) + ": record " + name + " does not have the CRC-32 its zip "
                                  "directory records; its bytes are damaged");
    }
  }
  return Status::Ok();
}

}  // namespace reshard
