#include "formats/folder_hint.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include "container/regular_file.h"
#include "formats/dcp/dcp_source.h"
#include "formats/dcp_common/megatron_tracker.h"
#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/megatron_core/torch/megatron_torch_import.h"
#include "util/list_folder.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kTracker[] = "latest_checkpointed_iteration.txt";
constexpr char kRelease[] = "release";

// A checkpoint folder inside a root, and the number its name gives it.
struct Inside {
  std::string name;
  int64_t number = 0;  // the step or iteration; release (-1) before every iteration
  bool torchtitan = false;
};

bool HasEntry(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found;
}

// Whether `dir` itself holds a checkpoint of Megatron-LM (torch) or a
// Distributed Checkpoint (torch_dist, torchtitan).
bool HoldsCheckpoint(const std::string& dir) {
  return MegatronTorchFolder(dir) == dir || DcpCheckpointFolder(dir) == dir;
}

// The number a checkpoint folder's name gives it: step-N (torchtitan),
// iter_NNNNNNN or release (Megatron-LM); nothing for any other name.
std::optional<Inside> Named(const std::string& name) {
  int64_t n = 0;
  if (name == kRelease) return Inside{name, -1, false};
  if (name.rfind("step-", 0) == 0 && ParseInt(name.substr(5), &n) && n >= 0) return Inside{name, n, true};
  if (name.rfind("iter_", 0) == 0 && name.size() >= 12 && ParseInt(name.substr(5), &n) && n >= 0) {
    return Inside{name, n, false};
  }
  return std::nullopt;
}

// The checkpoint folders inside `root`, oldest first.
Result<std::vector<Inside>> CheckpointsInside(const std::string& root) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListFolder(root));
  std::vector<Inside> found;
  for (const fs::directory_entry& entry : entries) {
    std::error_code ec;
    std::optional<Inside> named = Named(entry.path().filename().string());
    if (named && entry.is_directory(ec) && HoldsCheckpoint(entry.path().string())) found.push_back(*named);
  }
  std::sort(found.begin(), found.end(), [](const Inside& a, const Inside& b) {
    return a.number != b.number ? a.number < b.number : a.name < b.name;
  });
  return found;
}

std::string Names(const std::vector<Inside>& inside) {
  std::vector<std::string> names;
  for (const Inside& i : inside) names.push_back(i.name);
  return Join(names, ", ");
}

// "pass ROOT/NAME" for the one checkpoint inside, or which of several.
std::string PassInstead(const std::string& root, const std::vector<Inside>& inside) {
  if (inside.empty()) return "it holds no checkpoint folder (iter_NNNNNNN, release or step-N) to pass instead";
  const std::string newest = (fs::path(root) / inside.back().name).string();
  if (inside.size() == 1) return "it holds " + inside.back().name + ": pass " + newest;
  return "it holds " + Names(inside) + ": pass " + newest + " (the newest) or another of them";
}

// A root whose tracker no reader followed to a checkpoint: the folder it
// names when that one is a checkpoint after all, else what is wrong.
Result<std::string> ThroughTracker(const std::string& root, const std::vector<Inside>& inside) {
  const std::string tracker = (fs::path(root) / kTracker).string();
  Result<std::string> tracked = MegatronTrackedFolder(root);
  if (!tracked.ok()) return Status::InvalidInput(tracked.status().message() + "; " + PassInstead(root, inside));
  const std::string folder = *tracked;
  const auto named = std::find_if(inside.begin(), inside.end(), [&](const Inside& i) { return i.name == folder; });
  if (named != inside.end()) return (fs::path(root) / folder).string();
  const std::string why = HasEntry(fs::path(root) / folder)
                              ? ", which holds neither Megatron-LM's rank files (mp_rank_00/model_optim_rng.pt) "
                                "nor a Distributed Checkpoint (.metadata)"
                              : ", which " + root + " does not hold";
  return Status::InvalidInput(tracker + " names " + folder + why + "; " + PassInstead(root, inside) +
                              ", or write its iteration into " + kTracker);
}

// A DeepSpeed root without `latest`: which of its tag folders to pass (the
// one its `latest_universal` names, when it does).
Status DeepSpeedRootRefusal(const std::string& root, const std::vector<std::string>& tags) {
  const Result<std::string> universal = ReadRegularFile((fs::path(root) / "latest_universal").string(), 4096);
  if (universal.ok()) {
    const std::string named = universal->substr(0, universal->find_first_of("\r\n"));
    if (std::find(tags.begin(), tags.end(), named) != tags.end()) {
      return Status::InvalidInput(root + " holds no 'latest', and its latest_universal names the universal "
                                  "checkpoint " + named + ": pass " + (fs::path(root) / named).string());
    }
  }
  const std::string first = (fs::path(root) / tags.front()).string();
  const std::string pass = tags.size() == 1 ? first : first + " or another of them";
  return Status::InvalidInput(root + " is a DeepSpeed checkpoint root without the 'latest' file that names its tag; " +
                              "it holds " + Join(tags, ", ") + ": pass " + pass + ", or write the tag's name into " +
                              (fs::path(root) / "latest").string());
}

std::string RootKind(const std::vector<Inside>& inside) {
  const bool torchtitan = std::all_of(inside.begin(), inside.end(), [](const Inside& i) { return i.torchtitan; });
  const bool megatron = std::none_of(inside.begin(), inside.end(), [](const Inside& i) { return i.torchtitan; });
  if (torchtitan) return "a torchtitan checkpoint root";
  if (megatron) return std::string("a Megatron-LM checkpoint root without the ") + kTracker + " that names one";
  return "a folder of several checkpoints";
}

}  // namespace

Result<std::string> CheckpointInsideRoot(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec) || HasEntry(fs::path(path) / "latest")) return std::string();
  // A DeepSpeed root (Megatron-DeepSpeed's keeps a tracker too) is read
  // through `latest` alone.
  if (const std::vector<std::string> tags = TagFoldersIn(path); !tags.empty()) return DeepSpeedRootRefusal(path, tags);
  RESHARD_ASSIGN_OR_RETURN(std::vector<Inside> inside, CheckpointsInside(path));
  if (HasEntry(fs::path(path) / kTracker)) return ThroughTracker(path, inside);
  if (inside.empty()) return std::string();
  if (inside.size() == 1) return (fs::path(path) / inside.front().name).string();
  return Status::InvalidInput(path + " is " + RootKind(inside) + "; " + PassInstead(path, inside));
}

}  // namespace reshard
