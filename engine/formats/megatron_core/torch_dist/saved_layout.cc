#include "formats/megatron_core/torch_dist/saved_layout.h"

#include <filesystem>
#include <regex>
#include <set>

#include "util/strings.h"

namespace reshard {
namespace {

// The rank DCP names a data file after (`__3_0.distcp`: 3), or -1.
int64_t RankOfFile(const std::string& name) {
  static const std::regex kDataFile("__([0-9]+)_[0-9]+\\.distcp");
  std::smatch m;
  int64_t rank = -1;
  if (!std::regex_match(name, m, kDataFile) || !ParseInt(m[1].str(), &rank)) return -1;
  return rank;
}

// TP: the chunks of each split key along its TP dimension, when every key agrees.
int TpOfChunks(const DcpMetadata& meta, const std::map<std::string, TpSplit>& tp_splits) {
  int tp = 0;
  for (const auto& [key, split] : tp_splits) {
    auto it = meta.items.find(key);
    if (it == meta.items.end()) continue;
    std::set<int64_t> offsets;
    for (const DcpChunk& chunk : it->second.chunks) {
      if (split.dim >= static_cast<int>(chunk.offsets.size())) return 0;
      offsets.insert(chunk.offsets[split.dim]);
    }
    if (split.parts < 1 || offsets.size() % split.parts != 0) return 0;
    const int n = static_cast<int>(offsets.size()) / split.parts;
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
    for (const DcpChunk& chunk : it->second.chunks) {
      const DcpStorage* where = meta.Find(key, chunk.offsets);
      const int64_t rank = where == nullptr ? -1 : RankOfFile(where->relative_path);
      if (rank < 0 || chunk.offsets.empty()) return false;
      for (int64_t l = chunk.offsets[0]; l < chunk.offsets[0] + chunk.sizes[0]; ++l) layers_of_rank[rank].insert(l);
    }
  }
  for (const auto& [rank, layers] : layers_of_rank) {
    if (static_cast<int64_t>(layers.size()) == keys.layers) return true;
  }
  return false;
}

}  // namespace

SavedLayout DeriveSavedLayout(const DcpMetadata& meta, const std::vector<std::string>& data_files,
                              const SavedKeys& keys) {
  SavedLayout out;
  out.tp = TpOfChunks(meta, keys.tp_splits);
  std::set<int64_t> ranks;
  for (const std::string& name : data_files) {
    const int64_t rank = RankOfFile(name);
    if (rank < 0) return out;  // not DCP's own names: who wrote is not known
    ranks.insert(rank);
  }
  if (ranks.empty() || *ranks.rbegin() + 1 != static_cast<int64_t>(ranks.size())) return out;
  out.world = static_cast<int>(ranks.size());
  if (out.tp == 0 || out.world % out.tp != 0) return out;
  if (out.world == out.tp || OneRankWroteEveryLayer(meta, keys)) {
    out.pp = 1;
    out.dp = out.world / out.tp;
  }
  return out;
}

std::vector<std::string> DataFilesIn(const std::string& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string suffix = ".distcp";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.push_back(name);
    }
  }
  return out;
}

}  // namespace reshard
