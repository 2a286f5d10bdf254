#include "container/scratch_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "container/write_fully.h"

namespace reshard {
namespace {

std::string Error(const std::string& what, const std::string& dir, int error = errno) {
  return what + " a scratch file in " + dir + ": " + std::strerror(error);
}

// A file of `dir` without a name: O_TMPFILE, or where the file system lacks
// it, a file made and unlinked at once.
int OpenUnnamed(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)) return fd;
  std::string name = dir + "/.reshard-scratch-XXXXXX";
  std::vector<char> path(name.begin(), name.end());
  path.push_back('\0');
  const int named = ::mkostemp(path.data(), O_CLOEXEC);
  if (named >= 0) ::unlink(path.data());
  return named;
}

}  // namespace

Result<ScratchFile> ScratchFile::Create(const std::string& dir) {
  const int fd = OpenUnnamed(dir);
  if (fd < 0) return Status::IoError(Error("cannot make", dir));
  return ScratchFile(fd, dir);
}

ScratchFile::ScratchFile(ScratchFile&& other) noexcept : fd_(other.fd_), dir_(std::move(other.dir_)) {
  other.fd_ = -1;
}

ScratchFile& ScratchFile::operator=(ScratchFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    dir_ = std::move(other.dir_);
    other.fd_ = -1;
  }
  return *this;
}

ScratchFile::~ScratchFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status ScratchFile::Write(int64_t offset, const uint8_t* bytes, int64_t n) const {
  const int error = WriteFully(fd_, bytes, static_cast<size_t>(n), offset);
  return error == 0 ? Status::Ok() : Status::IoError(Error("cannot write", dir_, error));
}

Status ScratchFile::Read(int64_t offset, int64_t n, uint8_t* out) const {
  const int error = ReadFully(fd_, out, static_cast<size_t>(n), offset);
  return error == 0 ? Status::Ok() : Status::IoError(Error("cannot read", dir_, error));
}

void ScratchFolder::Use(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  dir_ = dir;
}

Result<ScratchFile> ScratchFolder::NewFile() const {
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dir = dir_;
  }
  if (dir.empty()) return Status::Internal("a scratch file was asked for before the run named its folder");
  return ScratchFile::Create(dir);
}

}  // namespace reshard
