#include "formats/megatron_core/torch_dist/saved_layout.h"

#include <set>

#include "formats/dcp_common/dcp_content.h"

namespace reshard {
namespace {

// TP: the chunks of each split key along its TP dimension, when every key agrees.
int TpOfChunks(const DcpMetadata& meta, const std::map<std::string, TpSplit>& tp_splits) {
  int tp = 0;
  for (const auto& [key, split] : tp_splits) {
    auto it = meta.items.find(key);
    if (it == meta.items.end()) continue;
    const int cuts = DistinctStartsAlong(it->second.chunks, split.dim);
    if (cuts == 0 || split.parts < 1 || cuts % split.parts != 0) return 0;
    const int n = cuts / split.parts;
    if (tp != 0 && n != tp) return 0;
    tp = n;
  }
  return tp;
}

// Whether one rank wrote a chunk of every layer of the stacked keys.
bool OneRankWroteEveryLayer(const DcpMetadata& meta, const SavedKeys& keys) {
  if (keys.layers < 1) return false;
  std::map<int64_t, std::set<int64_t>> layers_of_rank;
  for (const std::string& key : keys.stacked) {
    auto it = meta.items.find(key);
    if (it == meta.items.end()) continue;
    for (const Box& chunk : it->second.chunks) {
      const DcpStorage* where = meta.Find(key, chunk.offsets);
      const int64_t rank = where == nullptr ? -1 : RankOfDataFile(where->relative_path);
      if (rank < 0 || chunk.offsets.empty()) return false;
      for (int64_t l = chunk.offsets[0]; l < chunk.offsets[0] + chunk.sizes[0]; ++l) layers_of_rank[rank].insert(l);
    }
  }
  for (const auto& [rank, layers] : layers_of_rank) {
    if (static_cast<int64_t>(layers.size()) == keys.layers) return true;
  }
  return false;
}

// Whether one rank wrote a chunk of every expert of one layer of the keys
// that stack experts.
bool OneRankWroteEveryExpert(const DcpMetadata& meta, const SavedKeys& keys) {
  if (keys.experts < 1) return false;
  std::map<std::pair<int64_t, int64_t>, std::set<int64_t>> experts_of;  // (rank, layer) -> experts
  for (const std::string& key : keys.expert_stacked) {
    auto it = meta.items.find(key);
    if (it == meta.items.end()) continue;
    for (const Box& chunk : it->second.chunks) {
      const DcpStorage* where = meta.Find(key, chunk.offsets);
      const int64_t rank = where == nullptr ? -1 : RankOfDataFile(where->relative_path);
      if (rank < 0 || chunk.offsets.size() < 2) return false;
      for (int64_t l = chunk.offsets[0]; l < chunk.offsets[0] + chunk.sizes[0]; ++l) {
        for (int64_t e = chunk.offsets[1]; e < chunk.offsets[1] + chunk.sizes[1]; ++e) experts_of[{rank, l}].insert(e);
      }
    }
  }
  for (const auto& [at, experts] : experts_of) {
    if (static_cast<int64_t>(experts.size()) == keys.experts) return true;
  }
  return false;
}

}  // namespace

SavedLayout DeriveSavedLayout(const DcpMetadata& meta, int world, const SavedKeys& keys) {
  SavedLayout out;
  if (OneRankWroteEveryExpert(meta, keys)) out.ep = 1;
  out.tp = TpOfChunks(meta, keys.tp_splits);
  if (out.tp == 0 || world == 0 || world % out.tp != 0) return out;
  if (world == out.tp || OneRankWroteEveryLayer(meta, keys)) {
    out.pp = 1;
    out.dp = world / out.tp;
  }
  return out;
}

}  // namespace reshard
