// Building one target tensor from its source shards (engine/plan/materialize.h):
// the copy loop every converted weight and optimizer state goes through.
//
// Synthetic LogicalTensors of GPT-2 355M sizes (h=1024, ffn=4096) on two source
// TP ranks, merged into TP 1 as `convert --tp 1` does:
//   * row-parallel (split on dim 1): one short run per row per shard
//     (mlp.dense_4h_to_h.weight [1024, 4096]: 1024 runs of 4 KiB per bf16 shard);
//   * column-parallel (split on dim 0): one long run per shard
//     (mlp.dense_h_to_4h.weight [4096, 1024]);
//   * a replicated tensor averaged in double (--replicated average), position
//     embeddings [1024, 1024];
// each in bf16 (weights) and fp32 (masters and Adam moments).
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <vector>

#include "plan/materialize.h"
#include "logical/logical_checkpoint.h"
#include "plan/tensor_plan.h"

namespace reshard {
namespace {

struct Fixture {
  std::vector<Value> shard_values;  // own the shard tensors
  LogicalTensor tensor;
  TensorPlan plan;
};

// A tensor of `full` shape split over `tp` ranks along `dim`, merged back into
// TP 1 (or, with `average`, `tp` replicas of `full` averaged).
std::unique_ptr<Fixture> Make(DType dtype, std::vector<int64_t> full, int dim, int tp, bool average) {
  auto f = std::make_unique<Fixture>();
  std::vector<int64_t> local = full;
  if (!average) local[dim] /= tp;
  int64_t numel = 1;
  for (int64_t d : local) numel *= d;
  for (int t = 0; t < tp; ++t) {
    auto bytes = std::make_shared<std::vector<uint8_t>>(numel * ElementSize(dtype));
    for (size_t i = 0; i < bytes->size(); ++i) (*bytes)[i] = static_cast<uint8_t>(i * 31 + t);
    f->shard_values.push_back(MakeOwnedTensor(dtype, local, bytes));
  }
  f->tensor.key = "bench";
  f->tensor.dtype = dtype;
  f->tensor.local_shape = local;
  f->tensor.full_shape = full;
  for (size_t t = 0; t < f->shard_values.size(); ++t) {
    f->tensor.shards.push_back(
        SourceShard::Of(f->shard_values[t].as_tensor(), ShardCoords{static_cast<int>(t)}));
  }
  f->plan.shape = full;
  f->plan.cut_axis = dim;
  f->plan.average = average;
  if (!average) {
    for (int t = 0; t < tp; ++t) {
      f->plan.copies.push_back(BoxCopy{t, local, std::vector<int64_t>(local.size(), 0),
                                       Box::Slab(full, dim, t * local[dim], local[dim])});
    }
  }
  return f;
}

void Run(benchmark::State& state, DType dtype, std::vector<int64_t> full, int dim, bool average) {
  auto f = Make(dtype, std::move(full), dim, 2, average);
  const SourceTensor source = SourceTensor::Of(f->tensor);
  std::vector<uint8_t> out(static_cast<size_t>(f->plan.numel()) * ElementSize(dtype));
  int64_t read = 0;
  for (auto _ : state) {
    read = MaterializeRange(source, f->plan, 0, f->plan.numel(), out.data(), nullptr);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * read);  // source bytes read per second
  state.SetLabel(DTypeName(dtype));
}

void BM_MergeRowParallel(benchmark::State& state) {
  Run(state, static_cast<DType>(state.range(0)), {1024, 4096}, 1, false);
}
void BM_MergeColumnParallel(benchmark::State& state) {
  Run(state, static_cast<DType>(state.range(0)), {4096, 1024}, 0, false);
}
void BM_AverageReplicas(benchmark::State& state) {
  Run(state, static_cast<DType>(state.range(0)), {1024, 1024}, 0, true);
}

#define DTYPES ->Arg(static_cast<int>(DType::kBFloat16))->Arg(static_cast<int>(DType::kFloat32)) \
               ->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_MergeRowParallel) DTYPES;
BENCHMARK(BM_MergeColumnParallel) DTYPES;
BENCHMARK(BM_AverageReplicas) DTYPES;

// The same copies into a buffer that is reused without the zero fill that
// MaterializeTensor does first (`out->assign(n, 0)`): the bare memcpy cost,
// for comparison with BM_MergeColumnParallel.
void BM_MemcpyBaseline(benchmark::State& state) {
  const size_t bytes = 4096 * 1024 * static_cast<size_t>(state.range(0));
  std::vector<uint8_t> a(bytes / 2, 1), b(bytes / 2, 2), out(bytes);
  for (auto _ : state) {
    std::memcpy(out.data(), a.data(), a.size());
    std::memcpy(out.data() + a.size(), b.data(), b.size());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_MemcpyBaseline)->Arg(2)->Arg(4)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace reshard
