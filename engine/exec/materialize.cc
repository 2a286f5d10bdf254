#include "exec/materialize.h"

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

int64_t ApplyCopy(const LogicalTensor& t, const SliceCopy& c, const std::vector<int64_t>& dst_shape,
                  uint8_t* dst) {
  const int es = ElementSize(t.dtype);
  const DimSpan s = SpanOf(t.local_shape, c.dim);
  const DimSpan d = SpanOf(dst_shape, c.dim);
  const uint8_t* src = TensorData(*t.shards[c.src_rank]);
  const size_t run = static_cast<size_t>(c.length * s.inner * es);
  for (int64_t o = 0; o < s.outer; ++o) {
    std::memcpy(dst + ((o * d.extent + c.dst_start) * d.inner) * es,
                src + ((o * s.extent + c.src_start) * s.inner) * es, run);
  }
  return static_cast<int64_t>(run) * s.outer;
}

void ApplyFill(DType dtype, const SliceFill& f, const std::vector<int64_t>& dst_shape,
               uint8_t* dst) {
  const int es = ElementSize(dtype);
  const DimSpan d = SpanOf(dst_shape, f.dim);
  std::vector<uint8_t> element(es, 0);
  if (f.value != 0) StoreFromDouble(dtype, f.value, element.data());
  for (int64_t o = 0; o < d.outer; ++o) {
    uint8_t* row = dst + ((o * d.extent + f.dst_start) * d.inner) * es;
    for (int64_t i = 0; i < f.length * d.inner; ++i) std::memcpy(row + i * es, element.data(), es);
  }
}

int64_t Average(const LogicalTensor& t, uint8_t* dst) {
  const int es = ElementSize(t.dtype);
  const int64_t n = t.shards[0]->numel();
  const double ranks = static_cast<double>(t.shards.size());
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (const Tensor* shard : t.shards) sum += LoadAsDouble(t.dtype, TensorData(*shard) + i * es);
    StoreFromDouble(t.dtype, sum / ranks, dst + i * es);
  }
  return n * es * static_cast<int64_t>(t.shards.size());
}

}  // namespace

int64_t MaterializeTensor(const LogicalTensor& t, const TensorPlan& plan, std::vector<uint8_t>* out) {
  out->resize(static_cast<size_t>(plan.numel()) * ElementSize(t.dtype));
  return MaterializeInto(t, plan, out->data());
}

int64_t MaterializeInto(const LogicalTensor& t, const TensorPlan& plan, uint8_t* dst) {
  if (plan.average) return Average(t, dst);
  int64_t read = 0;
  for (const SliceCopy& c : plan.copies) read += ApplyCopy(t, c, plan.shape, dst);
  for (const SliceFill& f : plan.fills) ApplyFill(t.dtype, f, plan.shape, dst);
  return read;
}

}  // namespace reshard
