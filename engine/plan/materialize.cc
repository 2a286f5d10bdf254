#include "plan/materialize.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "util/crc32.h"

namespace reshard {
namespace {

// Row-major strides of `shape`, in elements.
std::vector<int64_t> Strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t a = shape.size(); a-- > 1;) strides[a - 1] = strides[a] * shape[a];
  return strides;
}

// The box `dst` of a target of `dst_shape`, read from the box of a source
// of `src_shape` at `src_offsets`, as runs of elements contiguous on both
// sides: the box's last axes that span both tensors whole join its runs.
class BoxRuns {
 public:
  BoxRuns(const std::vector<int64_t>& dst_shape, const std::vector<int64_t>& src_shape,
          const std::vector<int64_t>& src_offsets, const Box& dst)
      : dst_(dst), src_offsets_(src_offsets), dst_strides_(Strides(dst_shape)),
        src_strides_(Strides(src_shape)) {
    axis_ = dst.rank();  // runs span the axes from axis_ on
    while (axis_ > 0 && dst.sizes[axis_ - 1] == dst_shape[axis_ - 1] &&
           dst_shape[axis_ - 1] == src_shape[axis_ - 1]) {
      --axis_;
    }
    if (axis_ > 0) --axis_;  // and part of one more
    run_ = dst.rank() == 0 ? 1 : dst.sizes[axis_] * dst_strides_[axis_];
    count_ = dst.numel() == 0 ? 0 : 1;
    for (int a = 0; a < axis_; ++a) count_ *= dst.sizes[a];
  }

  // Calls f(dst_element, src_element, n) for the runs' elements inside
  // target elements [begin, end), in target order.
  template <typename F>
  void ForEach(int64_t begin, int64_t end, F f) const {
    // Runs start in increasing target order: find the first ending past begin.
    int64_t lo = 0, hi = count_;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (DstStart(mid) + run_ <= begin) lo = mid + 1; else hi = mid;
    }
    for (int64_t j = lo; j < count_; ++j) {
      int64_t dst = 0, src = 0;
      Starts(j, &dst, &src);
      if (dst >= end) break;
      const int64_t from = std::max(begin, dst), to = std::min(end, dst + run_);
      f(from, src + (from - dst), to - from);
    }
  }

 private:
  int64_t DstStart(int64_t j) const {
    int64_t dst = 0, src = 0;
    Starts(j, &dst, &src);
    return dst;
  }
  // The first target and source elements of run j (j counts the box's
  // indices over the axes before axis_, row-major).
  void Starts(int64_t j, int64_t* dst, int64_t* src) const {
    for (int a = dst_.rank() - 1; a >= 0; --a) {
      int64_t index = 0;
      if (a < axis_) {
        index = j % dst_.sizes[a];
        j /= dst_.sizes[a];
      }
      *dst += (dst_.offsets[a] + index) * dst_strides_[a];
      *src += (src_offsets_[a] + index) * src_strides_[a];
    }
  }

  const Box& dst_;
  const std::vector<int64_t>& src_offsets_;
  std::vector<int64_t> dst_strides_, src_strides_;
  int axis_ = 0;
  int64_t run_ = 0, count_ = 0;
};

// Runs shorter than this are gathered: those near each other in the source
// (a row of a tensor merged from TP shards cut along its columns, or half a
// row of one being cut so) are read with one copy, through the short gaps
// between them, and spread from there. A read per run would cost a system
// call and a record-check update per row, and such runs are too short for
// the kernel copy (container/kernel_copy.h) anyway, so no span is lost.
constexpr int64_t kShortRun = 16 << 10;
// At most this many bytes are read at once: the gathering scratch buffer.
constexpr int64_t kGatherBytes = 256 << 10;

// Copies runs of one source shard to the target buffer, gathering short
// runs into reads of the source range that holds them.
class RunCopier {
 public:
  RunCopier(const SourceShard& shard, int element_size, uint8_t* dst, TouchedPages* pages, const SpanSink& spans)
      : shard_(shard), es_(element_size), dst_(dst), pages_(pages), spans_(spans) {}
  // Target elements [at, at + n) (at counted from dst) are source elements [from, from + n).
  void Add(int64_t at, int64_t from, int64_t n) {
    if (n * es_ >= kShortRun) {
      Flush();
      shard_.Copy(from, n, es_, dst_ + at * es_, pages_, spans_);
      read_ += n * es_;
      return;
    }
    if (!pieces_.empty() && !Gathers(from, n)) Flush();
    if (pieces_.empty()) first_ = from;
    pieces_.push_back({at, from, n});
    next_ = from + n;
    used_ += n;
  }

  // Copies what is gathered; returns the source bytes read.
  int64_t Finish() {
    Flush();
    return read_;
  }

 private:
  struct Piece {
    int64_t at, from, n;
  };

  // Whether source elements [from, from + n) join the read: after the last
  // piece, across a short gap, with at least a quarter of the read used.
  bool Gathers(int64_t from, int64_t n) const {
    const int64_t span = from + n - first_;
    return from >= next_ && (from - next_) * es_ <= kShortRun && span * es_ <= kGatherBytes &&
           4 * (used_ + n) >= span;
  }

  void Flush() {
    if (pieces_.size() == 1) shard_.Copy(first_, pieces_[0].n, es_, dst_ + pieces_[0].at * es_, pages_, spans_);
    if (pieces_.size() > 1) {
      scratch_.resize(static_cast<size_t>((next_ - first_) * es_));
      shard_.Copy(first_, next_ - first_, es_, scratch_.data(), pages_);
      for (const Piece& p : pieces_) {
        std::memcpy(dst_ + p.at * es_, scratch_.data() + (p.from - first_) * es_, static_cast<size_t>(p.n * es_));
      }
    }
    if (!pieces_.empty()) read_ += (next_ - first_) * es_;
    pieces_.clear();
    used_ = 0;
  }

  const SourceShard& shard_;
  const int es_;
  uint8_t* const dst_;
  TouchedPages* const pages_;
  const SpanSink& spans_;
  std::vector<Piece> pieces_;
  int64_t first_ = 0, next_ = 0;  // the source elements the read spans
  int64_t used_ = 0;              // of them, the pieces'
  int64_t read_ = 0;
  std::vector<uint8_t> scratch_;
};

int64_t ApplyCopy(const SourceTensor& t, const BoxCopy& c, const std::vector<int64_t>& dst_shape,
                  int64_t begin, int64_t end, uint8_t* dst, TouchedPages* pages, const SpanSink& spans) {
  RunCopier copier(t.shards[c.src_shard], ElementSize(t.dtype), dst, pages, spans);
  BoxRuns(dst_shape, c.src_shape, c.src_offsets, c.dst).ForEach(begin, end, [&](int64_t at, int64_t from, int64_t n) {
    copier.Add(at - begin, from, n);
  });
  return copier.Finish();
}

void ApplyFill(DType dtype, const BoxFill& f, const std::vector<int64_t>& dst_shape, int64_t begin,
               int64_t end, uint8_t* dst) {
  const int es = ElementSize(dtype);
  uint8_t element[8] = {0};
  StoreFromDouble(dtype, f.value, element);
  BoxRuns(dst_shape, dst_shape, f.dst.offsets, f.dst).ForEach(begin, end, [&](int64_t at, int64_t, int64_t n) {
    uint8_t* out = dst + (at - begin) * es;
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * es, element, es);
  });
}

// The element-wise mean of every shard over [begin, end), a block at a time.
int64_t Average(const SourceTensor& t, int64_t begin, int64_t end, uint8_t* dst,
                TouchedPages* pages) {
  constexpr int64_t kBlock = 1 << 14;
  const int es = ElementSize(t.dtype);
  std::vector<uint8_t> replica(static_cast<size_t>(std::min(kBlock, end - begin)) * es);
  std::vector<double> sum(replica.size() / es);
  for (int64_t at = begin; at < end; at += kBlock) {
    const int64_t n = std::min(kBlock, end - at);
    std::fill(sum.begin(), sum.begin() + n, 0.0);
    for (const SourceShard& shard : t.shards) {
      shard.Copy(at, n, es, replica.data(), pages);
      for (int64_t i = 0; i < n; ++i) sum[i] += LoadAsDouble(t.dtype, replica.data() + i * es);
    }
    const double ranks = static_cast<double>(t.shards.size());
    for (int64_t i = 0; i < n; ++i) StoreFromDouble(t.dtype, sum[i] / ranks, dst + (at - begin + i) * es);
  }
  return (end - begin) * es * static_cast<int64_t>(t.shards.size());
}

// Where the target lies whole in a mapped source file: a plan that copies
// one shard stored as one run, whole and unchanged. Its check is the CRC of
// the record the run is (where the file's records are checked), computed
// from the mapping.
std::optional<InPlaceBytes> InPlaceOf(const SourceTensor& t, const TensorPlan& plan, std::atomic<int64_t>* read) {
  if (plan.average || !plan.fills.empty() || plan.copies.size() != 1) return std::nullopt;
  const BoxCopy& c = plan.copies[0];
  const SourceShard& shard = t.shards[c.src_shard];
  if (c.src_shape != plan.shape || c.dst.offsets != c.src_offsets || c.dst.sizes != plan.shape ||
      shard.runs.size() != 1 || shard.runs[0].numel != plan.numel() || !shard.runs[0].bytes.mapped) {
    return std::nullopt;
  }
  for (int64_t o : c.src_offsets) {
    if (o != 0) return std::nullopt;
  }
  const ByteView view = shard.runs[0].bytes;
  const auto* file = static_cast<const MappedFile*>(view.owner.get());
  if (file->fd() < 0) return std::nullopt;
  const int64_t n = plan.numel() * ElementSize(t.dtype);
  return InPlaceBytes{FileSpan{0, file->fd(), view.data - file->data(), n}, [view, n, read] {
                        const auto* file = static_cast<const MappedFile*>(view.owner.get());
                        if (file->ChecksRecords()) file->NoteRead(view.data, n, Crc32(0, view.data, n));
                        *read += n;
                        return Status::Ok();
                      }};
}

}  // namespace

SourceTensor SourceTensor::Of(const LogicalTensor& t) {
  return SourceTensor{t.dtype, t.shards};
}

int64_t MaterializeRange(const SourceTensor& src, const TensorPlan& plan, int64_t begin,
                         int64_t end, uint8_t* dst, TouchedPages* pages, const SpanSink& spans) {
  if (plan.average) return Average(src, begin, end, dst, pages);
  int64_t read = 0;
  // Copies and fills fill disjoint boxes, so no fill changes a noted span.
  for (const BoxCopy& c : plan.copies) read += ApplyCopy(src, c, plan.shape, begin, end, dst, pages, spans);
  for (const BoxFill& f : plan.fills) ApplyFill(src.dtype, f, plan.shape, begin, end, dst);
  return read;
}

Status ElementRange(int64_t offset, int64_t length, int element_size, int64_t* begin, int64_t* end) {
  if (offset % element_size != 0 || length % element_size != 0) {
    return Status::Internal("tensor bytes requested in a range not of whole elements");
  }
  *begin = offset / element_size;
  *end = *begin + length / element_size;
  return Status::Ok();
}

ByteProducer RangeProducer(SourceTensor source, TensorPlan plan, std::atomic<int64_t>* read) {
  std::optional<InPlaceBytes> in_place = InPlaceOf(source, plan, read);
  ByteProducer::TracedFill fill = [source = std::move(source), plan = std::move(plan), read](
                                      int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
    int64_t begin = 0, end = 0;
    RESHARD_RETURN_IF_ERROR(ElementRange(offset, length, ElementSize(source.dtype), &begin, &end));
    TouchedPages pages;
    *read += MaterializeRange(source, plan, begin, end, dst, &pages, spans);
    return Status::Ok();
  };
  if (!in_place) return ByteProducer::Traced(std::move(fill));
  return ByteProducer::InPlace(std::move(fill), std::move(*in_place));
}

}  // namespace reshard
