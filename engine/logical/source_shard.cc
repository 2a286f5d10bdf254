#include "logical/source_shard.h"

#include <algorithm>

#include "util/shape.h"

namespace reshard {
namespace {

// Elements between consecutive indices of each dim of a row-major `shape`.
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

// Appends the runs of the rows of `piece`'s box `at` (of its slice at
// indices `lead` of the first axes), each numbered by its element in a
// row-major tensor of `strides`, less `skip` (the elements before the slice).
void AppendRows(const SourceShard& piece, const Placement& at, const std::vector<int64_t>& lead,
                const std::vector<int64_t>& strides, int64_t skip, int element, std::vector<SourceShard::Run>* runs) {
  std::vector<int64_t> offsets = at.global.offsets, sizes = at.global.sizes, local = at.local;
  for (size_t d = 0; d < lead.size(); ++d) {
    if (lead[d] < offsets[d] || lead[d] >= offsets[d] + sizes[d]) return;
    local[d] += lead[d] - offsets[d];
    offsets[d] = lead[d];
    sizes[d] = 1;
  }
  const std::vector<int64_t> local_strides = RowMajorStrides(piece.shape);
  const int64_t row = sizes.empty() ? 1 : sizes.back();
  const int64_t rows = row == 0 ? 0 : ShapeNumel(sizes) / row;
  std::vector<int64_t> index(sizes.size(), 0);  // of the row's first element in the box
  for (int64_t r = 0; r < rows; ++r) {
    int64_t begin = -skip, from = 0;
    for (size_t d = 0; d < index.size(); ++d) {
      begin += (offsets[d] + index[d]) * strides[d];
      from += (local[d] + index[d]) * local_strides[d];
    }
    for (SourceShard::Run& run : piece.RunsOf(from, row, element)) {
      run.begin += begin;
      runs->push_back(std::move(run));
    }
    for (int d = static_cast<int>(index.size()) - 2; d >= 0; --d) {  // the next row
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace

const uint8_t* TensorData(const Tensor& t) {
  return t.storage->bytes.data + t.storage_offset * ElementSize(t.storage->dtype);
}

SourceShard SourceShard::Of(const Tensor& tensor, ShardCoords at) {
  const ByteView& file = tensor.storage->bytes;
  const size_t size = static_cast<size_t>(tensor.numel() * ElementSize(tensor.storage->dtype));
  SourceShard shard;
  shard.at = at;
  shard.shape = tensor.sizes;
  shard.runs.push_back({0, tensor.numel(), ByteView{file.owner, TensorData(tensor), size, file.mapped}});
  return shard;
}

SourceShard JoinRuns(const std::vector<SourceShard>& pieces, const std::vector<int64_t>& shape, int element_size,
                     int64_t layer) {
  return JoinRuns(pieces, shape, element_size, layer >= 0 ? std::vector<int64_t>{layer} : std::vector<int64_t>{});
}

SourceShard JoinRuns(const std::vector<SourceShard>& pieces, const std::vector<int64_t>& shape, int element_size,
                     const std::vector<int64_t>& lead) {
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  int64_t skip = 0;
  for (size_t d = 0; d < lead.size(); ++d) skip += lead[d] * strides[d];
  std::vector<SourceShard::Run> runs;
  for (const SourceShard& piece : pieces) {
    for (const Placement& at : piece.placements) AppendRows(piece, at, lead, strides, skip, element_size, &runs);
  }
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  SourceShard out;
  out.shape.assign(shape.begin() + static_cast<std::ptrdiff_t>(lead.size()), shape.end());
  for (SourceShard::Run& run : runs) {
    SourceShard::Run* last = out.runs.empty() ? nullptr : &out.runs.back();
    if (last != nullptr && last->begin + last->numel == run.begin && last->bytes.data + last->bytes.size == run.bytes.data) {
      last->numel += run.numel;
      last->bytes.size += run.bytes.size;
    } else {
      out.runs.push_back(std::move(run));
    }
  }
  return out;
}

int64_t SourceShard::numel() const {
  return runs.empty() ? 0 : runs.back().begin + runs.back().numel;
}

std::vector<SourceShard::Run> SourceShard::RunsOf(int64_t begin, int64_t n, int element_size) const {
  std::vector<Run> out;
  if (n <= 0) return out;
  auto run = std::upper_bound(runs.begin(), runs.end(), begin,
                              [](int64_t at, const Run& r) { return at < r.begin; });
  for (--run; n > 0; ++run) {
    const int64_t skip = begin - run->begin;
    const int64_t take = std::min(n, run->numel - skip);
    const ByteView& b = run->bytes;
    out.push_back({static_cast<int64_t>(out.empty() ? 0 : out.back().begin + out.back().numel), take,
                   ByteView{b.owner, b.data + skip * element_size, static_cast<size_t>(take) * element_size, b.mapped}});
    begin += take;
    n -= take;
  }
  return out;
}

void SourceShard::Copy(int64_t begin, int64_t n, int element_size, uint8_t* dst, TouchedPages* pages,
                       const SpanSink& spans) const {
  if (n <= 0) return;
  auto run = std::upper_bound(runs.begin(), runs.end(), begin,
                              [](int64_t at, const Run& r) { return at < r.begin; });
  for (--run; n > 0; ++run) {
    const int64_t skip = begin - run->begin;
    const int64_t take = std::min(n, run->numel - skip);
    const uint8_t* from = run->bytes.data + skip * element_size;
    const size_t bytes = static_cast<size_t>(take) * element_size;
    CopyFromView(run->bytes, from, bytes, dst, pages, spans);
    dst += bytes;
    begin += take;
    n -= take;
  }
}

}  // namespace reshard
