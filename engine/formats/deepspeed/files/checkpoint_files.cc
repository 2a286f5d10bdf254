#include "formats/deepspeed/files/checkpoint_files.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "exec/manifest.h"
#include "formats/deepspeed/files/file_names.h"
#include "util/list_folder.h"
#include "util/strings.h"

namespace reshard {
namespace fs = std::filesystem;
namespace {

std::string ReadFirstLine(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
  return line;
}

// Resolves a root-with-`latest` to its tag folder; leaves a tag folder as is.
Result<fs::path> ResolveTagDir(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return Status::InvalidInput("no such checkpoint folder: " + path.string());
  }
  if (!fs::is_directory(path, ec)) {
    return Status::InvalidInput(path.string() +
                                " is a file; pass a checkpoint tag folder (e.g. .../global_step20) "
                                "or the root folder holding 'latest'");
  }
  if (fs::is_empty(path, ec)) return Status::InvalidInput(path.string() + " is an empty folder");
  const fs::path latest = path / "latest";
  if (fs::is_regular_file(latest, ec)) {
    const std::string tag = ReadFirstLine(latest);
    // A tag is one folder inside the root: `..` or a path would read a
    // folder elsewhere as the checkpoint.
    if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
        tag.find('\0') != std::string::npos) {
      return Status::InvalidInput(latest.string() + " names '" + tag +
                                  "', which is not a tag folder name (one folder inside " +
                                  path.string() +
                                  ", not '.' or '..'); pass the tag folder itself, or write its "
                                  "name into latest");
    }
    if (!fs::is_directory(path / tag, ec)) {
      return Status::InvalidInput(latest.string() + " names '" + tag +
                                  "', but there is no such folder in " + path.string());
    }
    return path / tag;
  }
  return path;
}

}  // namespace

std::string FollowLatest(const std::string& path) {
  std::error_code ec;
  const fs::path latest = fs::path(path) / "latest";
  if (!fs::is_regular_file(latest, ec)) return path;
  const std::string tag = ReadFirstLine(latest);
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos) return path;
  return (fs::path(path) / tag).string();
}

namespace {

// Sorts `name` into its family. `ranks` maps each RankFileName seen to the
// file that had it: a second file of the same rank would silently replace
// the first, so it is refused.
Status Classify(const std::string& name, const std::string& full, CheckpointFiles* files,
                std::map<std::string, std::string>* ranks) {
  using Kind = DeepSpeedFileName::Kind;
  const DeepSpeedFileName f = ParseDeepSpeedFileName(name);
  if (f.kind != Kind::kOther) {
    const std::string rank = RankFileName(f);
    auto [seen, fresh] = ranks->emplace(rank, name);
    if (!fresh) {
      const auto [first, second] = std::minmax(seen->second, name);
      return Status::InvalidInput(files->tag_dir + " holds both " + first + " and " + second +
                                  ", which are the same rank file (" + rank +
                                  "); remove the one that does not belong to this checkpoint");
    }
  }
  switch (f.kind) {
    case Kind::kLayer: files->layer_files[f.layer][f.tp] = full; break;
    case Kind::kModelStates: files->mp_rank_files[f.mp] = full; break;
    case Kind::kOptimizer: files->optimizer_files.push_back({f.dp, f.mp, f.bf16, full}); break;
    case Kind::kZero3ModelStates: files->zero3_model_files[f.mp][f.dp] = full; break;
    case Kind::kExpert: files->expert_files[f.mp][f.layer][f.expert] = full; break;
    case Kind::kExpertOptimizer: files->expert_optimizer_files[f.mp][f.ep] = full; break;
    case Kind::kOther: files->other_files.push_back(name); break;
  }
  return Status::Ok();
}

// The first few of 0..n-1 missing from `present` ("3, 7, 8 and 1999999994
// more"); "" when none is. Counted before listed: a stray file name can make
// n absurd.
std::string MissingRanks(const std::set<int>& present, int n) {
  const int64_t inside = std::count_if(present.begin(), present.end(), [n](int r) { return r >= 0 && r < n; });
  const int64_t missing = n - inside;
  if (missing <= 0) return "";
  constexpr int kListed = 5;
  std::vector<std::string> first;
  for (int i = 0; i < n && static_cast<int>(first.size()) < kListed; ++i) {
    if (!present.count(i)) first.push_back(std::to_string(i));
  }
  std::string out = Join(first, ", ");
  if (missing > kListed) out += " and " + std::to_string(missing - kListed) + " more";
  return out;
}

}  // namespace

std::vector<std::string> TagFoldersIn(const std::string& dir) {
  std::vector<std::string> tags;
  Result<std::vector<fs::directory_entry>> entries = ListFolder(dir);
  if (!entries.ok()) return tags;
  for (const fs::directory_entry& entry : *entries) {
    std::error_code ec;
    if (entry.is_directory(ec) && fs::exists(entry.path() / "mp_rank_00_model_states.pt", ec)) {
      tags.push_back(entry.path().filename().string());
    }
  }
  std::sort(tags.begin(), tags.end());
  return tags;
}

std::vector<std::string> CheckpointFiles::Paths() const {
  std::vector<std::string> paths;
  for (const auto& [id, by_tp] : layer_files) {
    for (const auto& [tp, path] : by_tp) paths.push_back(path);
  }
  for (const auto& [mp, path] : mp_rank_files) paths.push_back(path);
  for (const OptimizerShardFile& f : optimizer_files) paths.push_back(f.path);
  for (const auto& [mp, by_dp] : zero3_model_files) {
    for (const auto& [dp, path] : by_dp) paths.push_back(path);
  }
  for (const auto& [mp, by_layer] : expert_files) {
    for (const auto& [m, by_expert] : by_layer) {
      for (const auto& [e, path] : by_expert) paths.push_back(path);
    }
  }
  for (const auto& [mp, by_ep] : expert_optimizer_files) {
    for (const auto& [ep, path] : by_ep) paths.push_back(path);
  }
  paths.insert(paths.end(), universal_files.begin(), universal_files.end());
  return paths;
}

int CheckpointFiles::LayerTpSize() const {
  std::set<int> ranks;
  for (const auto& [id, by_tp] : layer_files) {
    for (const auto& [tp, path] : by_tp) ranks.insert(tp);
  }
  return static_cast<int>(ranks.size());
}

Result<CheckpointFiles> ScanCheckpoint(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(fs::path tag_dir, ResolveTagDir(fs::path(path)));
  const bool via_root = tag_dir != fs::path(path);
  std::error_code ec;
  // Canonical (no symlink, `.`, `..` or trailing slash), so that the root is
  // the folder that really holds the tag and its `latest`.
  tag_dir = fs::canonical(tag_dir, ec);
  if (ec) return Status::IoError("cannot resolve " + path + ": " + ec.message());
  CheckpointFiles files;
  files.tag_dir = tag_dir.string();
  files.tag = tag_dir.filename().string();
  files.via_root = via_root;
  files.root_dir = tag_dir.parent_path().string();
  for (const char* script : kRootScripts) {
    if (fs::is_regular_file(fs::path(files.root_dir) / script, ec)) files.root_scripts.push_back(script);
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListFolder(files.tag_dir));
  std::map<std::string, std::string> ranks;
  for (const fs::directory_entry& entry : entries) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(ec) && name == "zero") {
      files.universal_dir = entry.path().string();
    } else if (entry.is_directory(ec)) {
      files.other_files.push_back(name + "/");
    } else if (name == kManifestName) {
      files.manifest = entry.path().string();
    } else {
      RESHARD_RETURN_IF_ERROR(Classify(name, entry.path().string(), &files, &ranks));
    }
  }
  if (files.mp_rank_files.empty() && !files.IsZero3()) {
    return Status::InvalidInput(files.tag_dir +
                                " has no mp_rank_*_model_states.pt files, so it is not a DeepSpeed "
                                "checkpoint tag folder");
  }
  return files;
}

Status CheckRankGrid(const CheckpointFiles& files, int* tp, int* pp, int* dp) {
  *tp = files.LayerTpSize();
  if (*tp == 0) *tp = 1;
  for (const auto& [id, by_tp] : files.layer_files) {
    std::set<int> ranks;
    for (const auto& [t, p] : by_tp) ranks.insert(t);
    const std::string missing = MissingRanks(ranks, *tp);
    if (!missing.empty() || static_cast<int>(ranks.size()) != *tp) {
      return Status::InvalidInput("layer " + std::to_string(id) + " is missing TP rank file(s) " +
                                  missing + " (other layers have " + std::to_string(*tp) +
                                  " TP ranks); the checkpoint is incomplete");
    }
  }
  const int mp = static_cast<int>(files.mp_rank_files.rbegin()->first) + 1;
  std::set<int> mp_ranks;
  for (const auto& [m, p] : files.mp_rank_files) mp_ranks.insert(m);
  if (const std::string missing = MissingRanks(mp_ranks, mp); !missing.empty()) {
    return Status::InvalidInput("mp_rank file(s) " + missing + " of " + std::to_string(mp) +
                                " are missing; the checkpoint is incomplete");
  }
  if (mp % *tp != 0) {
    return Status::InvalidInput(std::to_string(mp) + " mp_rank files do not divide into " +
                                std::to_string(*tp) + " TP ranks (from the layer files)");
  }
  *pp = mp / *tp;
  *dp = 0;
  if (files.optimizer_files.empty()) return Status::Ok();
  std::map<int, std::set<int>> dp_by_mp;
  int max_dp = 0;
  for (const auto& f : files.optimizer_files) {
    dp_by_mp[f.mp_rank].insert(f.dp_rank);
    max_dp = std::max(max_dp, f.dp_rank + 1);
  }
  for (int m = 0; m < mp; ++m) {
    const std::string missing = MissingRanks(dp_by_mp[m], max_dp);
    if (!missing.empty()) {
      return Status::InvalidInput("optimizer shard(s) for DP rank(s) " + missing +
                                  " of mp_rank " + std::to_string(m) +
                                  " are missing; the checkpoint is incomplete");
    }
  }
  if (static_cast<int>(dp_by_mp.size()) != mp) {
    return Status::InvalidInput("optimizer shards name mp_rank indices beyond the " +
                                std::to_string(mp) + " mp_rank files");
  }
  *dp = max_dp;
  return Status::Ok();
}

}  // namespace reshard
