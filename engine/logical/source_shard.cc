#include "logical/source_shard.h"

#include <algorithm>

namespace reshard {

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

void SourceShard::Copy(int64_t begin, int64_t n, int element_size, uint8_t* dst,
                       TouchedPages* pages) const {
  if (n <= 0) return;
  auto run = std::upper_bound(runs.begin(), runs.end(), begin,
                              [](int64_t at, const Run& r) { return at < r.begin; });
  for (--run; n > 0; ++run) {
    const int64_t skip = begin - run->begin;
    const int64_t take = std::min(n, run->numel - skip);
    const uint8_t* from = run->bytes.data + skip * element_size;
    const size_t bytes = static_cast<size_t>(take) * element_size;
    CopyFromView(run->bytes, from, bytes, dst, pages);
    dst += bytes;
    begin += take;
    n -= take;
  }
}

}  // namespace reshard
