#include "container/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>

#include "container/record_crc.h"
#include "container/regular_file.h"
#include "container/write_fully.h"
#include "util/crc32.h"

namespace reshard {
namespace {

// Every file mapped in this process, for the SIGBUS handler (which may only
// read) and for CheckMappedFilesUnchanged. Append-only with a fixed capacity,
// so the handler never sees a half-moved table; an unmapped file's entry is
// cleared, not removed.
struct MappedEntry {
  std::atomic<uintptr_t> begin{0}, end{0};
  const char* path = nullptr;  // never freed: the handler may still read it
  off_t size = 0;
  struct timespec mtime = {};
};
constexpr size_t kMaxMapped = 1 << 16;
MappedEntry mapped_files[kMaxMapped];
std::atomic<size_t> mapped_count{0};
std::mutex mapped_mu;  // writers only

// Descriptors kept open by MappedFile, and the most it may keep.
std::atomic<long> kept_descriptors{0};

long DescriptorBudget() {
  static const long budget = [] {
    struct rlimit limit;
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 1024L;
    return static_cast<long>(limit.rlim_cur / 2);
  }();
  return budget;
}

// Whether one more descriptor may be kept; if so, it is counted.
bool TakeDescriptor() {
  if (kept_descriptors.fetch_add(1) < DescriptorBudget()) return true;
  --kept_descriptors;
  return false;
}

void Register(const uint8_t* data, size_t size, const std::string& path, const struct stat& st) {
  std::lock_guard<std::mutex> lock(mapped_mu);
  const size_t i = mapped_count.load();
  if (i == kMaxMapped) return;  // beyond: no report, but still correct
  MappedEntry& e = mapped_files[i];
  e.path = ::strdup(path.c_str());
  e.size = st.st_size;
  e.mtime = st.st_mtim;
  e.end = reinterpret_cast<uintptr_t>(data) + size;
  e.begin = reinterpret_cast<uintptr_t>(data);
  mapped_count = i + 1;
}

void Unregister(const uint8_t* data) {
  std::lock_guard<std::mutex> lock(mapped_mu);
  for (size_t i = 0; i < mapped_count.load(); ++i) {
    if (mapped_files[i].begin == reinterpret_cast<uintptr_t>(data)) mapped_files[i].begin = mapped_files[i].end = 0;
  }
}

void WriteAll(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t done = ::write(STDERR_FILENO, s, n);
    if (done <= 0) return;
    s += done;
    n -= static_cast<size_t>(done);
  }
}

void OnBusError(int sig, siginfo_t* info, void*) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (size_t i = 0; i < mapped_count.load(); ++i) {
    const MappedEntry& e = mapped_files[i];
    if (at >= e.begin && at < e.end) {
      WriteAll("reshard: error: ");
      WriteAll(e.path);
      WriteAll(" shrank while reshard was reading it; nothing was published; rerun when nothing "
               "writes to the checkpoint\n");
      ::_exit(3);
    }
  }
  ::signal(sig, SIG_DFL);  // not a mapped file: a bug, die of it
  ::raise(sig);
}

}  // namespace

std::string MappedFile::Name(const FileWindow& window) const {
  if (window.offset == 0 && window.size == size_) return path_;
  return path_ + " [bytes " + std::to_string(window.offset) + "-" +
         std::to_string(window.offset + window.size) + ")";
}

Status MappedFile::CheckWindow(const FileWindow& window) const {
  if (window.offset <= size_ && window.size <= size_ - window.offset) return Status::Ok();
  return Status::InvalidInput(path_ + ": " + std::to_string(window.size) + " bytes at offset " +
                              std::to_string(window.offset) + " run past the file's end (" +
                              std::to_string(size_) + " bytes); the file is truncated or the "
                              "index that places them is damaged");
}

Status CheckMappedFilesUnchanged() {
  std::lock_guard<std::mutex> lock(mapped_mu);
  for (size_t i = 0; i < mapped_count.load(); ++i) {
    const MappedEntry& e = mapped_files[i];
    if (e.begin == 0) continue;
    struct stat st;
    const bool same = ::stat(e.path, &st) == 0 && st.st_size == e.size &&
                      st.st_mtim.tv_sec == e.mtime.tv_sec && st.st_mtim.tv_nsec == e.mtime.tv_nsec;
    if (!same) {
      return Status::IoError(std::string(e.path) + " changed while reshard was reading it; nothing was "
                             "published; rerun when nothing writes to the checkpoint");
    }
  }
  return Status::Ok();
}

void ReleaseMappedPages() {
  std::lock_guard<std::mutex> lock(mapped_mu);
  for (size_t i = 0; i < mapped_count.load(); ++i) {
    const MappedEntry& e = mapped_files[i];
    if (e.begin != 0) ::madvise(reinterpret_cast<void*>(e.begin.load()), e.end - e.begin, MADV_DONTNEED);
  }
}

void ReportBusErrorsOnMappedFiles() {
  struct sigaction action = {};
  action.sa_sigaction = OnBusError;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, nullptr);
}

Result<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(OpenedFile opened, OpenRegularFile(path));
  int fd = opened.fd;
  const struct stat& st = opened.st;
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
    Register(data, size, path, st);
  }
  // The mapping stays valid without the descriptor; it is kept for ReadInto.
  if (size == 0 || !TakeDescriptor()) {
    ::close(fd);
    fd = -1;
  }
  return std::shared_ptr<const MappedFile>(new MappedFile(path, data, size, fd));
}

MappedFile::~MappedFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    --kept_descriptors;
  }
  if (data_ == nullptr) return;
  Unregister(data_);
  ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::ReleasePages() const {
  if (data_ != nullptr) ::madvise(const_cast<uint8_t*>(data_), size_, MADV_DONTNEED);
}

bool MappedFile::ReadInto(const uint8_t* from, size_t n, uint8_t* dst) const {
  return fd_ >= 0 && ReadFully(fd_, dst, n, from - data_) == 0;
}

void MappedFile::NoteRead(const uint8_t* from, size_t n, uint32_t crc) const {
  if (crcs_ != nullptr) crcs_->Note(static_cast<uint64_t>(from - data_), n, crc);
}

void CopyFromView(const ByteView& view, const uint8_t* from, size_t n, uint8_t* dst,
                  TouchedPages* pages, const SpanSink& spans) {
  const auto* file = view.mapped ? static_cast<const MappedFile*>(view.owner.get()) : nullptr;
  if (file == nullptr || !file->ReadInto(from, n, dst)) {
    std::memcpy(dst, from, n);
    if (pages != nullptr) pages->Note(view, from, n);
  }
  if (file == nullptr) return;
  std::optional<uint32_t> crc;
  if (file->ChecksRecords()) {
    crc = Crc32(0, dst, n);  // from the copy, in cache
    file->NoteRead(from, n, *crc);
  }
  spans.Note(dst, file->fd(), from - file->data(), static_cast<int64_t>(n), crc);
}

void FetchExactly(const uint8_t* data, size_t n) {
  if (n == 0) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + n;
  // WILLNEED reads exactly these pages (no read-ahead marker is set), and a
  // fault on a page already in the cache reads nothing around it.
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
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
