// WriteFully / ReadFully: the whole of a byte range to or from a file
// descriptor, through short writes and reads and EINTR; FileCloser closes
// one however a write ends.
#pragma once

#include <cstddef>
#include <cstdint>

namespace reshard {

// Writes all of [data, data + n) at the file position (at < 0) or at `at`.
// Returns 0 or the errno of the failure.
int WriteFully(int fd, const uint8_t* data, size_t n, int64_t at = -1);

// Reads all of [at, at + n) of the file into `dst`. Returns 0, the errno of
// the failure, or EIO when the file ends first.
int ReadFully(int fd, uint8_t* dst, size_t n, int64_t at);

// Closes the descriptor it is given when it goes out of scope.
class FileCloser {
 public:
  explicit FileCloser(int fd) : fd_(fd) {}
  ~FileCloser();
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;

 private:
  int fd_;
};

}  // namespace reshard
