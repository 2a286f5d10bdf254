#include "container/zip_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "container/crc32.h"
#include "container/write_fully.h"
#include "container/zip_format.h"

namespace reshard {
namespace {

constexpr uint64_t kCrcOffset = 14;         // of the CRC inside a local header
constexpr uint16_t kUtf8Names = 1 << 11;    // general purpose flag, as PyTorch sets it
constexpr uint16_t kVersion20 = 20;         // "version needed": stored files
constexpr uint16_t kVersion45 = 45;         // ... with ZIP64 fields
constexpr uint64_t kAlignment = 64;         // of record data, as in PyTorch
constexpr size_t kBufferCapacity = 64 << 10;
// Add hands in-memory records over a piece at a time, so that each piece is
// still in cache when it is written after its CRC.
constexpr size_t kPieceSize = 1 << 20;

// Appends the `bytes` low bytes of `value`, little-endian (zip's byte order).
void Put(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

// PyTorch names the archive folder after the file: its name up to the last
// dot. It refuses names where that is empty; any folder reads back the same.
std::string ArchiveName(const std::string& path) {
  std::string name = path.substr(path.find_last_of('/') + 1);
  name = name.substr(0, name.find_last_of('.'));
  return name.empty() ? "archive" : name;
}

}  // namespace

Result<std::unique_ptr<ZipWriter>> ZipWriter::Create(const std::string& path,
                                                     const ZipWriterOptions& options) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return Status::IoError("cannot write " + path + ": " + std::strerror(errno));
  return std::unique_ptr<ZipWriter>(new ZipWriter(path, fd, options));
}

ZipWriter::ZipWriter(std::string path, int fd, const ZipWriterOptions& options)
    : path_(std::move(path)), archive_(ArchiveName(path_)), options_(options), fd_(fd) {
  buffer_.reserve(kBufferCapacity);
}

ZipWriter::~ZipWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status ZipWriter::Add(const std::string& name, const uint8_t* data, int64_t size) {
  RESHARD_RETURN_IF_ERROR(BeginRecord(name, size));
  uint32_t crc = 0;
  for (int64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kPieceSize, size - done));
    crc = Crc32(crc, data + done, n);
    RESHARD_RETURN_IF_ERROR(Write(data + done, n));
    done += static_cast<int64_t>(n);
  }
  return EndRecord(crc);
}

Status ZipWriter::AddStreamed(const std::string& name, int64_t size, const ByteProducer& produce,
                              std::vector<uint8_t>* buffer) {
  if (size > 0 && (buffer == nullptr || buffer->empty())) {
    return Status::Internal("ZipWriter::AddStreamed needs a buffer (record " + name + ")");
  }
  RESHARD_RETURN_IF_ERROR(BeginRecord(name, size));
  uint32_t crc = 0;
  for (int64_t done = 0; done < size;) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(buffer->size()), size - done);
    RESHARD_RETURN_IF_ERROR(produce(done, n, buffer->data()));
    crc = Crc32(crc, buffer->data(), static_cast<size_t>(n));
    RESHARD_RETURN_IF_ERROR(Write(buffer->data(), static_cast<size_t>(n)));
    done += n;
  }
  return EndRecord(crc);
}

Status ZipWriter::Finish() {
  if (fd_ < 0) return Status::Internal("ZipWriter::Finish called twice for " + path_);
  static const uint8_t kVersion[] = {'3', '\n'};  // what PyTorch 1.13's torch.save writes
  RESHARD_RETURN_IF_ERROR(Add("version", kVersion, sizeof(kVersion)));
  const uint64_t directory_offset = bytes_written();
  for (const Entry& entry : entries_) RESHARD_RETURN_IF_ERROR(WriteCentralHeader(entry));
  RESHARD_RETURN_IF_ERROR(WriteEndRecords(directory_offset, bytes_written() - directory_offset));
  RESHARD_RETURN_IF_ERROR(Flush());
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return IoError(errno);
  return Status::Ok();
}

// The local header, complete but for the CRC. Its extra field pads the
// header so that the data starts on a multiple of kAlignment.
Status ZipWriter::BeginRecord(const std::string& name, int64_t size) {
  const std::string full_name = archive_ + "/" + name;
  if (fd_ < 0) return Status::Internal("ZipWriter: record " + name + " added after Finish");
  if (size < 0) return Status::Internal("ZipWriter: negative size for record " + name);
  if (full_name.size() > kZipMax16) return Status::InvalidInput("record name too long: " + name);
  const uint64_t offset = bytes_written();
  const bool zip64 = Zip64(static_cast<uint64_t>(size));
  const uint64_t zip64_extra = zip64 ? 4 + 16 : 0;
  const uint64_t unpadded = offset + kZipLocalSize + full_name.size() + zip64_extra + 4;
  const uint64_t padding = (kAlignment - unpadded % kAlignment) % kAlignment;

  std::string header;
  Put(&header, kZipLocalSignature, 4);
  Put(&header, zip64 ? kVersion45 : kVersion20, 2);
  Put(&header, kUtf8Names, 2);
  Put(&header, 0, 2);  // method: stored
  Put(&header, 0, 4);  // time and date: none, for reproducible files
  Put(&header, 0, 4);  // CRC, patched by EndRecord
  Put(&header, zip64 ? kZipMax32 : size, 4);  // compressed size
  Put(&header, zip64 ? kZipMax32 : size, 4);  // uncompressed size
  Put(&header, full_name.size(), 2);
  Put(&header, zip64_extra + 4 + padding, 2);
  header += full_name;
  if (zip64) {
    Put(&header, kZip64ExtraId, 2);
    Put(&header, 16, 2);
    Put(&header, size, 8);  // uncompressed
    Put(&header, size, 8);  // compressed
  }
  header += "FB";
  Put(&header, padding, 2);
  header.append(padding, 'Z');
  entries_.push_back({full_name, offset, static_cast<uint64_t>(size), 0});
  in_record_ = true;
  open_header_ = header;
  return Write(header.data(), header.size());
}

Status ZipWriter::EndRecord(uint32_t crc) {
  entries_.back().crc = crc;
  std::string bytes;
  Put(&bytes, crc, 4);
  open_header_.replace(kCrcOffset, bytes.size(), bytes);
  file_crc_ = Crc32(file_crc_, reinterpret_cast<const uint8_t*>(open_header_.data()), open_header_.size());
  file_crc_ = Crc32Combine(file_crc_, crc, static_cast<int64_t>(entries_.back().size));
  in_record_ = false;
  return Patch(entries_.back().offset + kCrcOffset, bytes.data(), bytes.size());
}

Status ZipWriter::WriteCentralHeader(const Entry& entry) {
  const bool zip64_size = Zip64(entry.size);
  const bool zip64_offset = Zip64(entry.offset);
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
  Put(&header, kUtf8Names, 2);
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
  return Write(header.data(), header.size());
}

Status ZipWriter::WriteEndRecords(uint64_t directory_offset, uint64_t directory_size) {
  const uint64_t count = entries_.size();
  const bool zip64_count = count >= kZipMax16 || Zip64(count);
  const bool zip64_size = Zip64(directory_size);
  const bool zip64_offset = Zip64(directory_offset);
  std::string end;
  if (zip64_count || zip64_size || zip64_offset) {
    const uint64_t record_offset = directory_offset + directory_size;
    Put(&end, kZip64EndSignature, 4);
    Put(&end, 44, 8);  // size of the rest of this record
    Put(&end, kVersion45, 2);
    Put(&end, kVersion45, 2);
    Put(&end, 0, 4);  // this disk
    Put(&end, 0, 4);  // the directory's disk
    Put(&end, count, 8);
    Put(&end, count, 8);
    Put(&end, directory_size, 8);
    Put(&end, directory_offset, 8);
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
  Put(&end, zip64_size ? kZipMax32 : directory_size, 4);
  Put(&end, zip64_offset ? kZipMax32 : directory_offset, 4);
  Put(&end, 0, 2);  // comment length
  return Write(end.data(), end.size());
}

// Small pieces gather in buffer_; large ones go to the OS directly.
Status ZipWriter::Write(const void* data, size_t n) {
  const uint8_t* bytes = static_cast<const uint8_t*>(data);
  if (!in_record_) file_crc_ = Crc32(file_crc_, bytes, n);
  if (buffer_.size() + n > kBufferCapacity) {
    RESHARD_RETURN_IF_ERROR(Flush());
    if (n >= kBufferCapacity) {
      if (int err = WriteFully(fd_, bytes, n, -1)) return IoError(err);
      flushed_ += n;
      return Status::Ok();
    }
  }
  buffer_.insert(buffer_.end(), bytes, bytes + n);
  return Status::Ok();
}

Status ZipWriter::Flush() {
  if (int err = WriteFully(fd_, buffer_.data(), buffer_.size(), -1)) return IoError(err);
  flushed_ += buffer_.size();
  buffer_.clear();
  return Status::Ok();
}

// Overwrites bytes already written: in buffer_ if they are still there, else
// in the file (after a flush, in case they straddle the two).
Status ZipWriter::Patch(uint64_t offset, const void* data, size_t n) {
  if (offset >= flushed_) {
    std::memcpy(buffer_.data() + (offset - flushed_), data, n);
    return Status::Ok();
  }
  RESHARD_RETURN_IF_ERROR(Flush());
  const int err = WriteFully(fd_, static_cast<const uint8_t*>(data), n, static_cast<int64_t>(offset));
  return err == 0 ? Status::Ok() : IoError(err);
}

Status ZipWriter::IoError(int err) const {
  return Status::IoError("cannot write " + path_ + ": " + std::strerror(err));
}

}  // namespace reshard
