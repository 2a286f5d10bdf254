#include "util/byte_producer.h"

#include <algorithm>

#include "util/crc32.h"

namespace reshard {

void SpanSink::Note(const uint8_t* dst, int fd, int64_t offset, int64_t n, std::optional<uint32_t> crc) const {
  if (spans_ == nullptr || fd < 0 || n <= 0 || dst < base_ || dst + n > base_ + length_) return;
  const int64_t at = dst - base_;
  if (!spans_->empty()) {
    FileSpan& last = spans_->back();
    if (last.fd == fd && last.at + last.length == at && last.offset + last.length == offset) {
      last.crc = last.crc && crc ? std::optional<uint32_t>(Crc32Combine(*last.crc, *crc, n)) : std::nullopt;
      last.length += n;
      return;
    }
  }
  spans_->push_back({at, fd, offset, n, crc});
}

ByteProducer JoinedBytes(std::vector<PlacedBytes> pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const PlacedBytes& a, const PlacedBytes& b) { return a.begin < b.begin; });
  // Copies of the producer (one per chunk of a flat buffer) share the pieces.
  auto shared = std::make_shared<const std::vector<PlacedBytes>>(std::move(pieces));
  return ByteProducer::Traced([shared](int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
    std::fill(dst, dst + length, uint8_t{0});
    auto it = std::upper_bound(shared->begin(), shared->end(), offset,
                               [](int64_t at, const PlacedBytes& p) { return at < p.begin + p.bytes; });
    for (; it != shared->end() && it->begin < offset + length; ++it) {
      const int64_t lo = std::max(offset, it->begin);
      const int64_t hi = std::min(offset + length, it->begin + it->bytes);
      RESHARD_RETURN_IF_ERROR(it->from(lo - it->begin, hi - lo, dst + (lo - offset), spans));
    }
    return Status::Ok();
  });
}

}  // namespace reshard
