// ByteProducer: bytes made on demand, a range at a time.
//
// Large tensors are never built whole: a writer asks for one buffer-sized
// range after another, so memory stays bounded by the buffer, whatever the
// tensor's size.
//
// A producer may also say which of the bytes it made are a source file's
// bytes as they lie there (FileSpans), so that the writer can have the
// kernel copy those from the file (WriteProduced, container/write_fully.h)
// instead of pushing the produced copy through the process once more, and
// the CRC-32 of those bytes where it was computed as they were copied (to
// check the source's zip record), so that the writer need not read them
// again for the target's CRC (ProducedCrc, container/kernel_copy.h). Only
// producers made with ByteProducer::Traced say so: one that changes bytes
// after copying them (a cast, a transpose) is an ordinary one, and its
// spans are never asked for.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "reshard/status.h"

namespace reshard {

// Bytes [at, at + length) of a produced range are the bytes [offset, offset +
// length) of the open file `fd`.
struct FileSpan {
  int64_t at = 0;
  int fd = -1;
  int64_t offset = 0;
  int64_t length = 0;
  // The CRC-32 of those bytes, where the producer computed it.
  std::optional<uint32_t> crc = std::nullopt;
};

// The spans of one produced range, in the order they were noted (not
// always that of their place), each merged into the one before where it
// continues it in both (their CRCs joined).
using FileSpans = std::vector<FileSpan>;

// Where a traced producer notes its spans: the range's first byte `base`
// and its length, so that a producer filling a part of it anywhere (at
// dst + k) notes positions in the whole. Notes outside the range (a
// producer writing into scratch memory of its own) are dropped. An empty
// sink notes nothing.
class SpanSink {
 public:
  SpanSink() = default;
  SpanSink(FileSpans* spans, const uint8_t* base, int64_t length) : spans_(spans), base_(base), length_(length) {}

  // dst[0, n) were copied from bytes [offset, offset + n) of the file `fd`;
  // `crc`, where given, is their CRC-32.
  void Note(const uint8_t* dst, int fd, int64_t offset, int64_t n, std::optional<uint32_t> crc = {}) const;

 private:
  FileSpans* spans_ = nullptr;
  const uint8_t* base_ = nullptr;
  int64_t length_ = 0;
};

// A product that lies whole in one file as it is (a tensor stored
// contiguously): a reader that can use the file's bytes in place (map them)
// need not produce a copy, once `check` passes (what producing them would
// have checked, such as the CRC-32 of the record they are).
struct InPlaceBytes {
  FileSpan span;  // at 0, as long as the product
  std::function<Status()> check;
};

class ByteProducer {
 public:
  // Writes bytes [offset, offset + length) of the product into `dst`.
  using Fill = std::function<Status(int64_t offset, int64_t length, uint8_t* dst)>;
  // The same, noting in `spans` what of dst is a file's bytes.
  using TracedFill = std::function<Status(int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans)>;

  ByteProducer() = default;
  ByteProducer(std::nullptr_t) {}  // NOLINT: as std::function
  // Any callable of Fill's signature; it notes no spans.
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, ByteProducer> &&
                                                    std::is_invocable_r_v<Status, F&, int64_t, int64_t, uint8_t*>>>
  ByteProducer(F fill)  // NOLINT: implicit, as std::function
      : fill_([fill = std::move(fill)](int64_t offset, int64_t length, uint8_t* dst, const SpanSink&) mutable {
          return fill(offset, length, dst);
        }) {}

  // A producer whose `fill` notes the spans of the bytes it copies as they
  // are (and changes no byte it noted afterwards).
  static ByteProducer Traced(TracedFill fill) {
    ByteProducer p;
    p.fill_ = std::move(fill);
    return p;
  }

  // The same, known to lie whole in a file as `where` says.
  static ByteProducer InPlace(TracedFill fill, InPlaceBytes where) {
    ByteProducer p = Traced(std::move(fill));
    p.in_place_ = std::make_shared<const InPlaceBytes>(std::move(where));
    return p;
  }

  Status operator()(int64_t offset, int64_t length, uint8_t* dst) const { return fill_(offset, length, dst, {}); }
  Status operator()(int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) const {
    return fill_(offset, length, dst, spans);
  }
  explicit operator bool() const { return static_cast<bool>(fill_); }
  // Where the whole product lies in a file, for a producer made InPlace; null otherwise.
  const InPlaceBytes* in_place() const { return in_place_.get(); }

 private:
  TracedFill fill_;
  std::shared_ptr<const InPlaceBytes> in_place_;
};

// The bytes of `from` from byte `begin` on: a piece of a bigger product.
inline ByteProducer BytesFrom(ByteProducer from, int64_t begin) {
  return ByteProducer::Traced([from = std::move(from), begin](int64_t offset, int64_t length, uint8_t* dst,
                                                              const SpanSink& spans) {
    return from(begin + offset, length, dst, spans);
  });
}

// `bytes` bytes of a bigger product from byte `begin` on, made by `from`.
struct PlacedBytes {
  int64_t begin = 0;
  int64_t bytes = 0;
  ByteProducer from;
};

// The product of `pieces` at their places (which must not overlap), zero
// bytes between them (alignment gaps, a flat buffer's padding).
ByteProducer JoinedBytes(std::vector<PlacedBytes> pieces);

}  // namespace reshard
