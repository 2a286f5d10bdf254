#include "formats/accelerate/accelerate_import.h"

#include <algorithm>
#include <filesystem>
#include <regex>

#include "formats/hf_common/hf_folder.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kFullModelFile[] = "pytorch_model_fsdp.bin";
constexpr char kManifest[] = "reshard-manifest.json";
constexpr char kConfig[] = "config.json";
constexpr char kOptimizerState[] = "optimizer.state.";

bool IsDirectory(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(fs::symlink_status(p, ec));
}

bool Exists(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found;
}

// trainer_state.json's global_step; none without the file.
Result<std::optional<int64_t>> GlobalStep(const std::string& folder) {
  const fs::path path = fs::path(folder) / kTrainerStateFile;
  if (!Exists(path)) return std::optional<int64_t>();
  RESHARD_ASSIGN_OR_RETURN(Value state, ReadJsonFile(path.string()));
  const Value* step = Find(state, "global_step");
  if (step == nullptr || !step->is(Value::Kind::kInt) || step->as_int() < 0) {
    return Status::InvalidInput(path.string() + " holds no global_step count, which is the checkpoint's step; "
                                "restore the file the Trainer saved");
  }
  return std::optional<int64_t>(step->as_int());
}

// Whether the optimizer's state is keyed by parameter index
// (optimizer.state.<i>.<state>), as a plain optimizer.state_dict() is.
bool KeyedByIndex(const DcpTensors& dcp) {
  return std::any_of(dcp.tensors.begin(), dcp.tensors.end(), [](const auto& item) {
    if (!StartsWith(item.first, kOptimizerState)) return false;
    const std::string rest = item.first.substr(sizeof(kOptimizerState) - 1);
    const size_t dot = rest.find('.');
    int64_t index = 0;
    return dot != std::string::npos && rest.find('.', dot + 1) == std::string::npos &&
           ParseInt(rest.substr(0, dot), &index);
  });
}

}  // namespace

std::vector<std::string> AccelerateRunFiles(const std::string& folder) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != kAccelerateModelFolder && name != kAccelerateOptimizerFolder && name != kConfig && name != kManifest) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool IsRankRngState(const std::string& name) {
  static const std::regex rng("rng_state(_[0-9]+)?\\.pth");
  return std::regex_match(name, rng);
}

Result<std::string> AccelerateCheckpointFolder(const std::string& path) {
  const fs::path p = fs::path(path).lexically_normal();
  const fs::path folder = p.filename().empty() ? p.parent_path() : p;
  if (IsDirectory(folder / kAccelerateModelFolder)) return folder.string();
  const fs::path parent = folder.parent_path();
  const bool model_folder = folder.filename() == kAccelerateModelFolder &&
                            (IsDirectory(parent / kAccelerateOptimizerFolder) || Exists(parent / kTrainerStateFile));
  const bool optimizer_folder =
      folder.filename() == kAccelerateOptimizerFolder && IsDirectory(parent / kAccelerateModelFolder);
  if ((model_folder || optimizer_folder) && IsDirectory(folder)) {
    return parent.string();
  }
  if (Exists(folder / kFullModelFile)) {
    return Status::Unsupported(folder.string() + " is an Accelerate FULL_STATE_DICT save (" + kFullModelFile +
                               "), which reshard does not read; save the run with fsdp_state_dict_type "
                               "SHARDED_STATE_DICT, or convert the HF folder save_model writes");
  }
  return std::string();
}

Result<StateDictImport> ReadAccelerateImport(const DcpTensors& dcp, const CommonOptions& options) {
  StateDictKeys keys;
  keys.format = "accelerate";
  keys.label = "Accelerate FSDP checkpoint";
  keys.model_prefix = "model.";
  keys.optim_prefix = "optimizer.";
  keys.hf_keys = true;
  keys.recorded_config = kConfig;
  keys.iteration_from = kTrainerStateFile;
  RESHARD_ASSIGN_OR_RETURN(keys.iteration, GlobalStep(dcp.folder));
  Result<StateDictImport> imported = ReadStateDictImport(dcp, keys, options);
  if (!imported.ok()) {
    if (imported.status().code() != Status::Code::kUnsupported) return imported;
    return Status::Unsupported(imported.status().message() + "; the model's family needs a rule file whose hf "
                               "section names its HF model and whose torchtitan section gives its sizes "
                               "(docs/rules.md), given with --rules FILE");
  }
  if (KeyedByIndex(dcp)) {
    imported->optimizer.reset();
    imported->optimizer_status = Status::Unsupported(
        "the Accelerate FSDP checkpoint's optimizer state is keyed by parameter index (optimizer.state.<i>, as "
        "Accelerate saves an FSDP2 run's optimizer.state_dict()), which names no parameter; reshard reads FSDP1's "
        "FQN-keyed optim_state_dict; pass --weights-only to read the model");
  }
  if (const std::vector<std::string> run = AccelerateRunFiles(dcp.folder); !run.empty()) {
    imported->notes.push_back("accelerate: " + Join(run, ", ") + " not carried (the Trainer's run state, which "
                              "reshard never unpickles; export --to accelerate copies it, another format has no "
                              "place for it)");
  }
  return imported;
}

}  // namespace reshard
