#include "container/write_fully.h"

#include <unistd.h>

#include <cerrno>

namespace reshard {

int WriteFully(int fd, const uint8_t* data, size_t n, int64_t at) {
  while (n > 0) {
    const ssize_t done = at < 0 ? ::write(fd, data, n) : ::pwrite(fd, data, n, at);
    if (done < 0 && errno == EINTR) continue;
    if (done < 0) return errno;
    if (done == 0) return EIO;
    data += done;
    n -= static_cast<size_t>(done);
    if (at >= 0) at += done;
  }
  return 0;
}

int ReadFully(int fd, uint8_t* dst, size_t n, int64_t at) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, dst, n, at);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno;
    if (got == 0) return EIO;
    dst += got;
    n -= static_cast<size_t>(got);
    at += got;
  }
  return 0;
}

FileCloser::~FileCloser() { ::close(fd_); }

}  // namespace reshard
