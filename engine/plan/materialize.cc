#include "plan/materialize.h"

#include <algorithm>
#include <cstring>

namespace reshard {
namespace {

// Extent of `dim` and the elements per index of it (the product of later
// dims); a 0-d tensor is one index of one element.
struct DimSpan {
  int64_t outer = 1, extent = 1, inner = 1;
};

DimSpan SpanOf(const std::vector<int64_t>& shape, int dim) {
  DimSpan s;
  if (shape.empty()) return s;
  for (int i = 0; i < dim; ++i) s.outer *= shape[i];
  s.extent = shape[dim];
  for (size_t i = dim + 1; i < shape.size(); ++i) s.inner *= shape[i];
  return s;
}

// Calls f(dst_offset, src_offset, n) for every run of target elements in
// [begin, end) that slice `c` fills; offsets are element indices of the
// flattened target and source tensors. A slice fills one block of
// length * inner elements per outer index.
template <typename F>
void ForEachRun(const DimSpan& d, const DimSpan& s, int64_t dst_start, int64_t src_start,
                int64_t length, int64_t begin, int64_t end, F f) {
  const int64_t block = length * d.inner;
  const int64_t stride = d.extent * d.inner;
  if (block == 0 || stride == 0) return;
  for (int64_t o = begin / stride; o < d.outer && o * stride < end; ++o) {
    const int64_t block_begin = o * stride + dst_start * d.inner;
    const int64_t lo = std::max(begin, block_begin);
    const int64_t hi = std::min(end, block_begin + block);
    if (lo >= hi) continue;
    const int64_t src = (o * s.extent + src_start) * s.inner + (lo - block_begin);
    f(lo, src, hi - lo);
  }
}

int64_t ApplyCopy(const SourceTensor& t, const SliceCopy& c, const std::vector<int64_t>& dst_shape,
                  int64_t begin, int64_t end, uint8_t* dst, TouchedPages* pages) {
  const int es = ElementSize(t.dtype);
  const SourceShard& shard = t.shards[c.src_shard];
  int64_t read = 0;
  ForEachRun(SpanOf(dst_shape, c.dim), SpanOf(t.local_shape, c.dim), c.dst_start, c.src_start,
             c.length, begin, end, [&](int64_t at, int64_t from, int64_t n) {
               shard.Copy(from, n, es, dst + (at - begin) * es, pages);
               read += n * es;
             });
  return read;
}

void ApplyFill(DType dtype, const SliceFill& f, const std::vector<int64_t>& dst_shape,
               int64_t begin, int64_t end, uint8_t* dst) {
  const int es = ElementSize(dtype);
  uint8_t element[8] = {0};
  StoreFromDouble(dtype, f.value, element);
  const DimSpan d = SpanOf(dst_shape, f.dim);
  ForEachRun(d, d, f.dst_start, f.dst_start, f.length, begin, end,
             [&](int64_t at, int64_t, int64_t n) {
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

}  // namespace

SourceTensor SourceTensor::Of(const LogicalTensor& t) {
  return SourceTensor{t.dtype, t.local_shape, t.shards};
}

int64_t MaterializeRange(const SourceTensor& src, const TensorPlan& plan, int64_t begin,
                         int64_t end, uint8_t* dst, TouchedPages* pages) {
  if (plan.average) return Average(src, begin, end, dst, pages);
  int64_t read = 0;
  for (const SliceCopy& c : plan.copies) read += ApplyCopy(src, c, plan.shape, begin, end, dst, pages);
  for (const SliceFill& f : plan.fills) ApplyFill(src.dtype, f, plan.shape, begin, end, dst);
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
  return [source = std::move(source), plan = std::move(plan), read](
             int64_t offset, int64_t length, uint8_t* dst) {
    int64_t begin = 0, end = 0;
    RESHARD_RETURN_IF_ERROR(ElementRange(offset, length, ElementSize(source.dtype), &begin, &end));
    TouchedPages pages;
    *read += MaterializeRange(source, plan, begin, end, dst, &pages);
    return Status::Ok();
  };
}

}  // namespace reshard
