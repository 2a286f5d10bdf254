// MappedFile: a read-only memory map of a whole file. Tensor storages read
// from checkpoints point into it, so data is paged in only when touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pickle/value.h"
#include "reshard/status.h"
#include "util/byte_producer.h"

namespace reshard {

class RecordCrcs;  // container/record_crc.h

// A byte range of a file that holds a container of its own: PyTorch
// Distributed Checkpoint stores each item as a whole torch.save archive at an
// offset of a `.distcp` file, with offsets inside it relative to its start.
struct FileWindow {
  uint64_t offset = 0;
  uint64_t size = 0;
};

class MappedFile {
 public:
  static Result<std::shared_ptr<const MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The open descriptor of the file, or -1 when it was not kept (see fd_).
  int fd() const { return fd_; }
  // The whole file as a window.
  FileWindow whole() const { return FileWindow{0, size_}; }
  // Refuses a window that does not lie inside the file (InvalidInput).
  Status CheckWindow(const FileWindow& window) const;
  // How messages name the bytes of `window`: the path alone for the whole
  // file, else "path [bytes a-b)".
  std::string Name(const FileWindow& window) const;

  // Drops the file's pages from this process; they stay in the page cache
  // and are read again from it when touched.
  void ReleasePages() const;

  // Copies the mapped bytes [from, from + n) to `dst` with pread, so that no
  // page of them is mapped into this process. False when the file's
  // descriptor was not kept (see fd_) or the read fell short: the caller then
  // copies from the mapping, where a file that shrank is reported.
  bool ReadInto(const uint8_t* from, size_t n, uint8_t* dst) const;

  // Has the CRC-32 of `crcs`' records checked as CopyFromView copies them
  // out; set once, before the file's bytes are read by more than one thread
  // (the records of a file's further archives are added to it: record_crcs).
  void CheckRecords(std::shared_ptr<RecordCrcs> crcs) const { crcs_ = std::move(crcs); }
  bool ChecksRecords() const { return crcs_ != nullptr; }
  const std::shared_ptr<RecordCrcs>& record_crcs() const { return crcs_; }
  // Tells the record check (if any) that [from, from + n) was read, and
  // that `crc` is its CRC-32.
  void NoteRead(const uint8_t* from, size_t n, uint32_t crc) const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size, int fd)
      : path_(std::move(path)), data_(data), size_(size), fd_(fd) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
  // The open descriptor of the mapped file, or -1. Descriptors are kept for
  // at most half the process's limit of open files, so that a checkpoint of
  // many files never takes the descriptors its outputs need.
  int fd_;
  mutable std::shared_ptr<RecordCrcs> crcs_;
};

// Reads the pages of [data, data + n), memory that maps a file, into the page
// cache, and no more. For small reads scattered over a file (zip headers,
// the norms and biases of a layer file): a page fault reads the kernel's
// whole read-around window (read_ahead_kb, 8 MiB on some disks) around the
// page it hits, which for a file of a few MiB is all of it.
void FetchExactly(const uint8_t* data, size_t n);

// Whether every file mapped now is as it was when it was mapped (size and
// modification time): a checkpoint rewritten under a run must not yield an
// output that looks good.
Status CheckMappedFilesUnchanged();

// MappedFile::ReleasePages of every file mapped now. Reading a checkpoint's
// structure maps a few pages of each file, which would otherwise stay
// resident for the whole run.
void ReleaseMappedPages();

// Makes a read past the end of a mapped file that shrank under the run
// (SIGBUS) end the process with one line naming the file, exit status 3.
void ReportBusErrorsOnMappedFiles();

// The pages of mapped source bytes one piece of work has read, so that they
// can be released when it is done: mapped pages count as the process's
// resident memory until dropped, and a conversion reads the whole checkpoint.
// Views that are not file mappings are ignored; those that are must be owned
// by their MappedFile.
class TouchedPages {
 public:
  TouchedPages() = default;
  TouchedPages(const TouchedPages&) = delete;
  TouchedPages& operator=(const TouchedPages&) = delete;
  ~TouchedPages() { Release(); }

  // Records that [data, data + n) inside `view` was read.
  void Note(const ByteView& view, const uint8_t* data, size_t n);
  // Drops the recorded pages from this process (they stay in the page cache).
  void Release();

 private:
  struct Range {
    const uint8_t* begin;
    const uint8_t* end;
    const uint8_t* mapping_begin;  // the whole file mapping the range lies in
    const uint8_t* mapping_end;
  };
  std::vector<Range> ranges_;
};

// Copies [from, from + n), bytes inside `view`, to `dst`. From a file
// mapping the bytes are read with MappedFile::ReadInto: a page fault maps
// whole large folios (up to 2 MiB) around the page it hits, which stay
// resident beside even a small read until released. When that cannot be
// done, and for views that are not mappings, the bytes are copied from
// memory and the pages of a mapping noted in `pages` (may be null). The copy
// of a file's bytes is noted in `spans` (util/byte_producer.h), with the
// CRC-32 the file's record check computed from it: the one pass over the
// bytes checks the source and gives the target its CRC.
void CopyFromView(const ByteView& view, const uint8_t* from, size_t n, uint8_t* dst,
                  TouchedPages* pages, const SpanSink& spans = {});

}  // namespace reshard
