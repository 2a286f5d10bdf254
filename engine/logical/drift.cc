#include "logical/drift.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "container/mapped_file.h"

namespace reshard {
namespace {

// Compares one replica with rank 0's; updates `d` when they differ. Read a
// block at a time through SourceShard::Copy, so that a large replica is
// never mapped whole.
void CompareReplica(const LogicalTensor& t, int rank, Drift* d) {
  constexpr int64_t kBlock = 1 << 16;
  const SourceShard& base = t.shards[0];
  const SourceShard& replica = t.shards[rank];
  const int64_t n = base.numel();
  const int es = ElementSize(t.dtype);
  std::vector<uint8_t> a(static_cast<size_t>(std::min(kBlock, n)) * es), b(a.size());
  const bool fp = IsFloatingPoint(t.dtype);
  for (int64_t at = 0; at < n; at += kBlock) {
    const int64_t len = std::min(kBlock, n - at);
    TouchedPages pages;
    base.Copy(at, len, es, a.data(), &pages);
    replica.Copy(at, len, es, b.data(), &pages);
    if (std::memcmp(a.data(), b.data(), static_cast<size_t>(len) * es) == 0) continue;
    for (int64_t i = 0; i < len; ++i) {
      const uint8_t* x = a.data() + i * es;
      const uint8_t* y = b.data() + i * es;
      if (std::memcmp(x, y, es) == 0) continue;
      ++d->elements_differing;
      const double diff = fp ? std::fabs(LoadAsDouble(t.dtype, x) - LoadAsDouble(t.dtype, y)) : 1;
      // NaN differences rank as infinitely large.
      const double key = std::isnan(diff) ? INFINITY : diff;
      if (key > d->max_abs_diff) {
        d->max_abs_diff = key;
        d->worst_rank = rank;
      }
    }
  }
}

}  // namespace

std::vector<Drift> MeasureDrift(const LogicalCheckpoint& ckpt) {
  std::vector<Drift> drifts;
  for (size_t li = 0; li < ckpt.layers.size(); ++li) {
    const LogicalLayer& layer = ckpt.layers[li];
    for (size_t ti = 0; ti < layer.tensors.size(); ++ti) {
      const LogicalTensor& t = layer.tensors[ti];
      if (t.rule->policy != ParamRule::Policy::kReplicated) continue;
      Drift d;
      d.layer_index = static_cast<int>(li);
      d.tensor_index = static_cast<int>(ti);
      for (size_t r = 1; r < t.shards.size(); ++r) CompareReplica(t, static_cast<int>(r), &d);
      if (d.elements_differing > 0) drifts.push_back(d);
    }
  }
  std::stable_sort(drifts.begin(), drifts.end(), [](const Drift& a, const Drift& b) {
    return a.max_abs_diff > b.max_abs_diff;
  });
  return drifts;
}

std::string DescribeDrift(const LogicalCheckpoint& ckpt, const Drift& d) {
  const LogicalLayer& layer = ckpt.layers[d.layer_index];
  const LogicalTensor& t = layer.tensors[d.tensor_index];
  char buf[160];
  std::snprintf(buf, sizeof(buf), ": max |diff| %.3g (TP rank %d vs 0), %lld of %lld elements differ",
                d.max_abs_diff, d.worst_rank, static_cast<long long>(d.elements_differing),
                static_cast<long long>(t.shards[0].numel()));
  return t.label + buf;
}

}  // namespace reshard
