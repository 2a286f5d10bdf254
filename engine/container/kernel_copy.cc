#include "container/kernel_copy.h"

#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <utility>
#include <vector>

#include "container/write_fully.h"
#include "util/crc32.h"

namespace reshard {
namespace {

// Shorter spans go out with the bytes around them: a system call per span
// would cost more than it saves.
constexpr int64_t kMinKernelCopy = 16 << 10;

// Joining a CRC (zlib's crc32_combine, about 0.45 us) costs as much as
// computing that of some 16 KiB in cache; a shorter span's is computed again.
constexpr int64_t kMinReusedCrc = 32 << 10;

// The (source, target) file systems between which the kernel refused to
// copy. Asked for before every kernel copy, so the common case (nothing
// refused) costs an atomic load, not two fstat calls.
class Refusals {
 public:
  bool Refused(int from, int to) {
    if (!any_.load(std::memory_order_relaxed)) return false;
    const std::pair<dev_t, dev_t> pair = Devices(from, to);
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : refused_) {
      if (p == pair) return true;
    }
    return false;
  }
  void Refuse(int from, int to) {
    const std::pair<dev_t, dev_t> pair = Devices(from, to);
    std::lock_guard<std::mutex> lock(mu_);
    refused_.push_back(pair);
    any_ = true;
  }

 private:
  static std::pair<dev_t, dev_t> Devices(int from, int to) {
    struct stat a = {}, b = {};
    ::fstat(from, &a);
    ::fstat(to, &b);
    return {a.st_dev, b.st_dev};
  }
  std::atomic<bool> any_{false};
  std::mutex mu_;
  std::vector<std::pair<dev_t, dev_t>> refused_;
};

Refusals& KernelRefusals() {
  static Refusals* refusals = new Refusals;
  return *refusals;
}

// What copy_file_range answers when the file systems (or the kernel) cannot
// copy between these files, rather than that something failed (a target
// that cannot be written fails the write that would replace the copy too).
bool IsRefusal(int err) { return err == EXDEV || err == EINVAL || err == EOPNOTSUPP || err == ENOSYS; }

// Copies the span into `fd` at `at` (< 0: the file position); *copied is
// how much was, which is short of the span where the kernel refused or the
// source ended. Returns 0 or the errno of a failure.
int CopySpan(const FileSpan& span, int fd, int64_t at, int64_t* copied) {
  *copied = 0;
  while (*copied < span.length) {
    loff_t in = span.offset + *copied, out = at + *copied;
    const ssize_t done = ::copy_file_range(span.fd, &in, fd, at < 0 ? nullptr : &out,
                                           static_cast<size_t>(span.length - *copied), 0);
    if (done > 0) {
      *copied += done;
    } else if (done == 0) {
      return 0;
    } else if (errno != EINTR) {
      if (!IsRefusal(errno)) return errno;
      KernelRefusals().Refuse(span.fd, fd);
      return 0;
    }
  }
  return 0;
}

// `spans` in the order of their place in the range, or none if any two
// overlap or one lies outside the n bytes.
FileSpans Ordered(const FileSpans& spans, size_t n) {
  FileSpans ordered = spans;
  std::sort(ordered.begin(), ordered.end(), [](const FileSpan& a, const FileSpan& b) { return a.at < b.at; });
  int64_t end = 0;
  for (const FileSpan& s : ordered) {
    if (s.at < end || s.length < 0 || s.at + s.length > static_cast<int64_t>(n)) return {};
    end = s.at + s.length;
  }
  return ordered;
}

}  // namespace

int WriteProduced(int fd, const uint8_t* data, size_t n, int64_t at, const FileSpans& spans) {
  if (spans.empty()) return WriteFully(fd, data, n, at);
  const auto end = static_cast<int64_t>(n);
  int64_t done = 0;  // bytes of data in the file
  const auto write_up_to = [&](int64_t upto) {
    const int err = WriteFully(fd, data + done, static_cast<size_t>(upto - done), at < 0 ? -1 : at + done);
    done = upto;
    return err;
  };
  for (const FileSpan& span : Ordered(spans, n)) {
    if (span.length < kMinKernelCopy || KernelRefusals().Refused(span.fd, fd)) continue;
    if (int err = write_up_to(span.at)) return err;
    int64_t copied = 0;
    if (int err = CopySpan(span, fd, at < 0 ? -1 : at + span.at, &copied)) return err;
    done += copied;
  }
  return write_up_to(end);
}

uint32_t ProducedCrc(uint32_t crc, const uint8_t* data, size_t n, const FileSpans& spans) {
  int64_t done = 0;  // bytes of data in the CRC
  for (const FileSpan& span : Ordered(spans, n)) {
    if (!span.crc || span.length < kMinReusedCrc) continue;
    crc = Crc32(crc, data + done, static_cast<size_t>(span.at - done));
    crc = Crc32Combine(crc, *span.crc, span.length);
    done = span.at + span.length;
  }
  return Crc32(crc, data + done, n - static_cast<size_t>(done));
}

bool CloneFile(int from, int to) { return ::ioctl(to, FICLONE, from) == 0; }

}  // namespace reshard
