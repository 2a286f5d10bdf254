// Element conversions to and from double (engine/pickle/dtype.h): the inner
// loop of averaging replicated tensors (--replicated average) and of casting
// merged fp32 masters back to bf16 weights.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "pickle/dtype.h"

namespace reshard {
namespace {

constexpr int64_t kElements = 1 << 20;

// kElements values of `dtype` from a normal(0, 0.02) draw, like weights.
std::vector<uint8_t> Values(DType dtype) {
  std::mt19937 gen(42);
  std::normal_distribution<double> dist(0.0, 0.02);
  const int es = ElementSize(dtype);
  std::vector<uint8_t> out(kElements * es);
  for (int64_t i = 0; i < kElements; ++i) StoreFromDouble(dtype, dist(gen), out.data() + i * es);
  return out;
}

void BM_LoadAsDouble(benchmark::State& state) {
  const DType dtype = static_cast<DType>(state.range(0));
  const std::vector<uint8_t> in = Values(dtype);
  const int es = ElementSize(dtype);
  for (auto _ : state) {
    double sum = 0;
    for (int64_t i = 0; i < kElements; ++i) sum += LoadAsDouble(dtype, in.data() + i * es);
    benchmark::DoNotOptimize(sum);
  }
  state.SetItemsProcessed(state.iterations() * kElements);
  state.SetBytesProcessed(state.iterations() * kElements * es);
  state.SetLabel(DTypeName(dtype));
}

void BM_StoreFromDouble(benchmark::State& state) {
  const DType dtype = static_cast<DType>(state.range(0));
  const int es = ElementSize(dtype);
  std::vector<double> in(kElements);
  std::mt19937 gen(7);
  std::normal_distribution<double> dist(0.0, 0.02);
  for (double& v : in) v = dist(gen);
  std::vector<uint8_t> out(kElements * es);
  for (auto _ : state) {
    for (int64_t i = 0; i < kElements; ++i) StoreFromDouble(dtype, in[i], out.data() + i * es);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kElements);
  state.SetBytesProcessed(state.iterations() * kElements * es);
  state.SetLabel(DTypeName(dtype));
}

// The round trip of a weight rebuilt from its averaged master: fp32 -> double -> bf16.
void BM_Fp32ToBf16ViaDouble(benchmark::State& state) {
  const std::vector<uint8_t> in = Values(DType::kFloat32);
  std::vector<uint8_t> out(kElements * 2);
  for (auto _ : state) {
    for (int64_t i = 0; i < kElements; ++i) {
      StoreFromDouble(DType::kBFloat16, LoadAsDouble(DType::kFloat32, in.data() + 4 * i), out.data() + 2 * i);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kElements);
}

#define DTYPE_ARGS ->Arg(static_cast<int>(DType::kBFloat16))->Arg(static_cast<int>(DType::kFloat16)) \
                   ->Arg(static_cast<int>(DType::kFloat32))->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_LoadAsDouble) DTYPE_ARGS;
BENCHMARK(BM_StoreFromDouble) DTYPE_ARGS;
BENCHMARK(BM_Fp32ToBf16ViaDouble)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace reshard
