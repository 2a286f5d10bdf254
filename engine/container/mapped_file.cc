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
  const auto* file = static_cast<const MappedFile*>(view.owner.get());
  ranges_.push_back({data, data + n, file->data(), file->data() + file->size()});
}

void TouchedPages::Release() {
  // A page fault maps more than the page it hits: the kernel's fault-around
  // window (64 KiB by default) and whole large folios (up to 2 MiB) around
  // it, on both sides. Pages it mapped outside a range that was already
  // released would stay resident, a few per read, and grow with the
  // checkpoint; so each range is released out to 2 MiB boundaries, kept
  // inside its own mapping. A neighbour dropped this way is read again from
  // the page cache when touched.
  constexpr uintptr_t kAround = uintptr_t{2} << 20;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const Range& r : ranges_) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(r.mapping_begin);  // page-aligned
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(r.mapping_end) + page - 1) & ~(page - 1);
    const uintptr_t begin = std::max(lo, reinterpret_cast<uintptr_t>(r.begin) & ~(kAround - 1));
    const uintptr_t end = std::min(hi, (reinterpret_cast<uintptr_t>(r.end) + kAround - 1) & ~(kAround - 1));
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
  ranges_.clear();
}

}  // namespace reshard
