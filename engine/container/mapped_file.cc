#include "container/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

namespace reshard {

Result<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Status::IoError("cannot stat " + path + ": " + std::strerror(err));
  }
  size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return Status::IoError("cannot map " + path + ": " + std::strerror(err));
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return std::shared_ptr<const MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void TouchedPages::Note(const ByteView& view, const uint8_t* data, size_t n) {
  if (!view.mapped || n == 0) return;
  // Reads mostly continue where the last one from the same place ended; gaps
  // of a few pages are released with their neighbours.
  constexpr size_t kJoin = 1 << 16;
  for (Range& r : ranges_) {
    if (data <= r.end + kJoin && data + n + kJoin >= r.begin) {
      r.begin = std::min(r.begin, data);
      r.end = std::max(r.end, data + n);
      return;
    }
  }
  ranges_.push_back({data, data + n});
}

void TouchedPages::Release() {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const Range& r : ranges_) {
    // Whole pages around the range: they all belong to the mapping, and any
    // neighbour dropped with them is simply read again.
    const uintptr_t begin = reinterpret_cast<uintptr_t>(r.begin) & ~(page - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(r.end) + page - 1) & ~(page - 1);
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
  ranges_.clear();
}

}  // namespace reshard
