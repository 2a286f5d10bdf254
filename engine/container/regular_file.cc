#include "container/regular_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "container/kernel_copy.h"
#include "container/write_fully.h"

namespace reshard {
namespace {

std::string KindOf(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a folder";
  return "not a regular file";
}

}  // namespace

Result<OpenedFile> OpenRegularFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IoError("cannot stat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidInput(path + " is " + KindOf(st.st_mode) + ", not a regular file; reshard reads "
                                "only regular files (replace it with the file itself)");
  }
  // O_NONBLOCK means nothing to a regular file's reads; it is cleared so
  // that the descriptor is an ordinary one.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return OpenedFile{fd, st};
}

Result<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes) {
  RESHARD_ASSIGN_OR_RETURN(OpenedFile file, OpenRegularFile(path));
  if (file.st.st_size > max_bytes) {
    ::close(file.fd);
    return Status::InvalidInput(path + " has " + std::to_string(file.st.st_size) + " bytes, more than the " +
                                std::to_string(max_bytes) + " such a file may have");
  }
  std::string text(static_cast<size_t>(file.st.st_size), '\0');
  // Only the size fstat gave is read: a file that grows is not followed.
  const int err = ReadFully(file.fd, reinterpret_cast<uint8_t*>(text.data()), text.size(), 0);
  ::close(file.fd);
  if (err != 0) return Status::IoError("cannot read " + path + ": " + std::strerror(err));
  return text;
}

Status CopyRegularFile(const std::string& from, const std::string& to, std::vector<uint8_t>& buffer,
                       FileDigest* digest, const std::function<void(int64_t)>& copied, const SeenBytes& seen) {
  RESHARD_ASSIGN_OR_RETURN(OpenedFile in, OpenRegularFile(from));
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (out < 0) {
    const int err = errno;
    ::close(in.fd);
    return Status::IoError("cannot write " + to + ": " + std::strerror(err));
  }
  *digest = {};
  int read_err = 0, write_err = 0;
  // A clone shares the source's extents; the bytes are still read for the
  // digest (and to notice a source that ends early).
  const bool cloned = CloneFile(in.fd, out);
  while (digest->bytes < in.st.st_size && read_err == 0 && write_err == 0) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buffer.size()),
                                                           in.st.st_size - digest->bytes));
    read_err = ReadFully(in.fd, buffer.data(), n, digest->bytes);
    const FileSpans same = {FileSpan{0, in.fd, digest->bytes, static_cast<int64_t>(n)}};
    if (read_err == 0 && !cloned) write_err = WriteProduced(out, buffer.data(), n, -1, same);
    if (read_err != 0 || write_err != 0) break;
    const uint32_t crc = seen ? seen(digest->bytes, buffer.data(), n) : Crc32(0, buffer.data(), n);
    digest->crc32 = Crc32Combine(digest->crc32, crc, static_cast<int64_t>(n));
    digest->bytes += static_cast<int64_t>(n);
    if (copied) copied(static_cast<int64_t>(n));
  }
  ::close(in.fd);
  if (::close(out) != 0 && write_err == 0) write_err = errno;
  if (read_err != 0) return Status::IoError("cannot read " + from + ": " + std::strerror(read_err));
  if (write_err != 0) return Status::IoError("cannot write " + to + ": " + std::strerror(write_err));
  return Status::Ok();
}

}  // namespace reshard
