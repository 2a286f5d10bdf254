#include "container/zip_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "container/kernel_copy.h"
#include "container/write_fully.h"
#include "container/zip_records.h"
#include "util/crc32.h"

namespace reshard {
namespace {

constexpr size_t kBufferCapacity = 64 << 10;
// Add hands in-memory records over a piece at a time, so that each piece is
// still in cache when it is written after its CRC.
constexpr size_t kPieceSize = 1 << 20;

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
    : path_(std::move(path)), archive_(ArchiveName(path_)), style_{options.zip64_threshold}, fd_(fd) {
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
  FileSpans spans;
  for (int64_t done = 0; done < size;) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(buffer->size()), size - done);
    spans.clear();
    RESHARD_RETURN_IF_ERROR(produce(done, n, buffer->data(), SpanSink(&spans, buffer->data(), n)));
    crc = ProducedCrc(crc, buffer->data(), static_cast<size_t>(n), spans);
    RESHARD_RETURN_IF_ERROR(WriteProducedBytes(buffer->data(), static_cast<size_t>(n), spans));
    done += n;
  }
  return EndRecord(crc);
}

Status ZipWriter::Finish() {
  if (fd_ < 0) return Status::Internal("ZipWriter::Finish called twice for " + path_);
  static const uint8_t kVersion[] = {'3', '\n'};  // what PyTorch 1.13's torch.save writes
  RESHARD_RETURN_IF_ERROR(Add("version", kVersion, sizeof(kVersion)));
  const uint64_t directory_offset = bytes_written();
  for (const ZipEntry& entry : entries_) RESHARD_RETURN_IF_ERROR(WriteCentralHeader(entry));
  RESHARD_RETURN_IF_ERROR(WriteEndRecords(directory_offset, bytes_written() - directory_offset));
  RESHARD_RETURN_IF_ERROR(Flush());
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return IoError(errno);
  return Status::Ok();
}

// The local header, complete but for the CRC.
Status ZipWriter::BeginRecord(const std::string& name, int64_t size) {
  const std::string full_name = archive_ + "/" + name;
  if (fd_ < 0) return Status::Internal("ZipWriter: record " + name + " added after Finish");
  if (size < 0) return Status::Internal("ZipWriter: negative size for record " + name);
  if (full_name.size() > kZipMax16) return Status::InvalidInput("record name too long: " + name);
  entries_.push_back({full_name, static_cast<uint64_t>(bytes_written()), static_cast<uint64_t>(size), 0});
  in_record_ = true;
  open_header_ = ZipLocalHeader(entries_.back(), style_);
  return Write(open_header_.data(), open_header_.size());
}

Status ZipWriter::EndRecord(uint32_t crc) {
  entries_.back().crc = crc;
  std::string bytes;
  for (int i = 0; i < 4; ++i) bytes += static_cast<char>(crc >> (8 * i));
  open_header_.replace(kZipLocalCrcOffset, bytes.size(), bytes);
  file_crc_ = Crc32(file_crc_, reinterpret_cast<const uint8_t*>(open_header_.data()), open_header_.size());
  file_crc_ = Crc32Combine(file_crc_, crc, static_cast<int64_t>(entries_.back().size));
  in_record_ = false;
  return Patch(entries_.back().offset + kZipLocalCrcOffset, bytes.data(), bytes.size());
}

Status ZipWriter::WriteCentralHeader(const ZipEntry& entry) {
  const std::string header = ZipCentralHeader(entry, style_);
  return Write(header.data(), header.size());
}

Status ZipWriter::WriteEndRecords(uint64_t directory_offset, uint64_t directory_size) {
  const std::string end = ZipEndRecords(entries_.size(), directory_offset, directory_size, style_);
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

// Record data only (the file's CRC takes a record's whole when it ends).
Status ZipWriter::WriteProducedBytes(const uint8_t* data, size_t n, const FileSpans& spans) {
  if (spans.empty()) return Write(data, n);
  RESHARD_RETURN_IF_ERROR(Flush());
  if (int err = WriteProduced(fd_, data, n, -1, spans)) return IoError(err);
  flushed_ += n;
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
