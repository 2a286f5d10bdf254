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

namespace reshard {

class MappedFile {
 public:
  static Result<std::shared_ptr<const MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
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

}  // namespace reshard
