// CRC-32 throughput: ZipWriter computes it over every byte it writes, so it
// must stay well ahead of the disk. Sizes range from a record piece that fits
// in L1 to one streamed from memory.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "util/crc32.h"

namespace reshard {
namespace {

void BM_Crc32(benchmark::State& state) {
  std::vector<uint8_t> data(static_cast<size_t>(state.range(0)));
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  uint32_t crc = 0;
  for (auto _ : state) {
    crc = Crc32(crc, data.data(), data.size());
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Crc32)->Arg(4 << 10)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace reshard
