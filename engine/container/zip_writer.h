// ZipWriter: writes the zip container of a torch.save file front to back,
// streaming each record through a caller-owned buffer.
//
// The layout follows PyTorch 1.13's writer, so torch.load (and
// PyTorchStreamReader) read it: every record is stored uncompressed under
// `<archive>/`, its data aligned to 64 bytes by an "FB" local extra field
// padded with 'Z', and the file ends with the `<archive>/version` record.
// Unlike PyTorch's, it needs no data descriptors: sizes are given before the
// data, so each local header is complete when it is written except for the
// CRC, which is patched in once the data has passed. ZIP64 fields and end
// records are written only where a size, an offset or the entry count needs
// them. The output is deterministic: timestamps are zero, as in PyTorch's.
//
// After any error the writer must only be destroyed; the file is incomplete.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "container/zip_records.h"
#include "reshard/status.h"
#include "util/byte_producer.h"

namespace reshard {

struct ZipWriterOptions {
  // Sizes and offsets at or above this are written as ZIP64 fields. Only
  // tests lower it, to get ZIP64 files without writing 4 GiB.
  uint64_t zip64_threshold = 0xFFFFFFFF;
};

class ZipWriter {
 public:
  // Creates (truncates) `path`. The archive folder is named after the file,
  // as PyTorch does: "x/y.pt" gets "y/"; a name with nothing before its
  // extension gets "archive/".
  static Result<std::unique_ptr<ZipWriter>> Create(const std::string& path,
                                                   const ZipWriterOptions& options = {});
  // Closes the file if Finish was not called (it is then incomplete).
  ~ZipWriter();
  ZipWriter(const ZipWriter&) = delete;
  ZipWriter& operator=(const ZipWriter&) = delete;

  // Writes the record `<archive>/<name>` holding [data, data + size).
  Status Add(const std::string& name, const uint8_t* data, int64_t size);
  // Writes the record `<archive>/<name>` of `size` bytes, asking `produce`
  // for them in order, at most buffer->size() bytes at a time, into `buffer`
  // (which must not be empty unless size is 0); the bytes it says are a
  // file's the kernel copies from there (container/kernel_copy.h).
  Status AddStreamed(const std::string& name, int64_t size, const ByteProducer& produce,
                     std::vector<uint8_t>* buffer);
  // Writes the version record, the central directory and the end records,
  // and closes the file.
  Status Finish();

  // The CRC-32 of the whole file (valid after Finish), computed as it was
  // written: each record's header and data are folded in when its CRC is known.
  uint32_t file_crc() const { return file_crc_; }
  // Bytes of the file so far (including those not yet handed to the OS).
  int64_t bytes_written() const { return static_cast<int64_t>(flushed_ + buffer_.size()); }
  const std::string& archive() const { return archive_; }

 private:
  ZipWriter(std::string path, int fd, const ZipWriterOptions& options);
  Status BeginRecord(const std::string& name, int64_t size);
  Status EndRecord(uint32_t crc);
  Status WriteCentralHeader(const ZipEntry& entry);
  Status WriteEndRecords(uint64_t directory_offset, uint64_t directory_size);
  Status Write(const void* data, size_t n);
  Status WriteProducedBytes(const uint8_t* data, size_t n, const FileSpans& spans);
  Status Flush();
  Status Patch(uint64_t offset, const void* data, size_t n);
  Status IoError(int err) const;

  const std::string path_;
  const std::string archive_;
  const ZipStyle style_;  // PyTorch 1.13's: no data descriptors
  int fd_;
  uint64_t flushed_ = 0;         // bytes handed to the OS; buffer_ follows them
  std::vector<uint8_t> buffer_;  // headers and small pieces of data
  std::vector<ZipEntry> entries_;
  uint32_t file_crc_ = 0;    // of the bytes before the open record
  bool in_record_ = false;   // between BeginRecord and EndRecord
  std::string open_header_;  // the open record's local header, CRC to be patched
};

}  // namespace reshard
