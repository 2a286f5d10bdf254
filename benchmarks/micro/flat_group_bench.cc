// The flat layout of one optimizer group (engine/formats/deepspeed/model/flat_group.h): computing
// every DP rank's fragments (param_slice_mappings) and finding parameters by
// name, which SourceOptimizer::Gather does once per parameter, state and TP
// rank (a linear scan over the group's slots).
//
// The group is one pipeline stage of a GPT-2 355M-style model at TP 1: the
// weight-decayed parameters of `blocks` transformer blocks (6 per block).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "formats/deepspeed/model/flat_group.h"

namespace reshard {
namespace {

std::vector<ParamShape> StageParams(int blocks) {
  const int64_t h = 1024, ffn = 4096;
  std::vector<ParamShape> out;
  out.push_back({"tied_modules.embed.word_embeddings.weight", {50304, h}});
  out.push_back({"tied_modules.embed.position_embeddings.weight", {1024, h}});
  for (int b = 0; b < blocks; ++b) {
    const std::string p = std::to_string(b + 3) + ".";
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "self_attention.query_key_value.weight", {3 * h, h}});
    out.push_back({p + "self_attention.dense.weight", {h, h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    out.push_back({p + "mlp.dense_h_to_4h.weight", {ffn, h}});
    out.push_back({p + "mlp.dense_4h_to_h.weight", {h, ffn}});
  }
  return out;
}

// range(0): blocks in the stage; range(1): DP size.
void BM_FlatGroupFragments(benchmark::State& state) {
  const int dp = static_cast<int>(state.range(1));
  const FlatGroup group(StageParams(static_cast<int>(state.range(0))), dp, 2 * dp);
  size_t fragments = 0;
  for (auto _ : state) {
    fragments = 0;
    for (int d = 0; d < dp; ++d) {
      std::vector<Fragment> f = group.Fragments(d);
      fragments += f.size();
      benchmark::DoNotOptimize(f.data());
    }
  }
  state.counters["slots"] = static_cast<double>(group.slots().size());
  state.counters["fragments"] = static_cast<double>(fragments);
  state.SetItemsProcessed(state.iterations() * dp);  // DP ranks laid out
}
BENCHMARK(BM_FlatGroupFragments)->Args({6, 4})->Args({24, 4})->Args({24, 64})->Args({96, 512})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace reshard
