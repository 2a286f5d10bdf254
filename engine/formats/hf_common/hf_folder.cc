#include "formats/hf_common/hf_folder.h"

#include <filesystem>
#include <set>

#include "container/json_reader.h"
#include "container/regular_file.h"
#include "container/safetensors_reader.h"
#include "container/torch_file.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kConfig[] = "config.json";
// The weight files transformers looks for, in the order it prefers them:
// a single file, or an index naming the shards.
constexpr const char* kWeightNames[][2] = {
    {"model.safetensors", "model.safetensors.index.json"},
    {"pytorch_model.bin", "pytorch_model.bin.index.json"},
};

// Whether an entry of that name is there, of whatever kind but a folder: a
// FIFO or a dangling link named model.safetensors is then refused by name
// when it is read, instead of the folder being taken for another format.
bool Exists(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found && !fs::is_directory(p, ec);
}

// The tensors of one weight file, by name.
Result<std::vector<std::pair<std::string, Value>>> ReadWeightFile(const fs::path& path) {
  const std::string name = path.filename().string();
  if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") {
    RESHARD_ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(path.string()));
    return std::move(file.tensors);
  }
  RESHARD_ASSIGN_OR_RETURN(Value root, ReadTorchFile(path.string()));
  const Items* items = DictItems(root);
  if (items == nullptr) return Status::InvalidInput(path.string() + " does not hold a state dict (name -> tensor)");
  std::vector<std::pair<std::string, Value>> tensors;
  for (const auto& [key, v] : *items) {
    if (!key.is(Value::Kind::kString) || !v.is(Value::Kind::kTensor)) {
      return Status::InvalidInput(path.string() + " holds " + key.DebugString(60) + ", which is not a named "
                                  "tensor; transformers weight files hold a state dict (name -> tensor)");
    }
    tensors.emplace_back(key.as_string(), v);
  }
  return tensors;
}

// The shards of an index file and the tensors it places in each.
Result<std::map<std::string, std::set<std::string>>> ReadIndex(const fs::path& path) {
  RESHARD_ASSIGN_OR_RETURN(Value index, ReadJsonFile(path.string()));
  const Value* map = Find(index, "weight_map");
  const Items* items = map != nullptr ? DictItems(*map) : nullptr;
  if (items == nullptr) return Status::InvalidInput(path.string() + " has no weight_map; it is not a weight index");
  std::map<std::string, std::set<std::string>> shards;
  for (const auto& [name, file] : *items) {
    const std::string shard = file.is(Value::Kind::kString) ? file.as_string() : "";
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return Status::InvalidInput(path.string() + " places " + name.as_string() + " in '" + shard +
                                  "', which is not a file name in the folder");
    }
    shards[shard].insert(name.as_string());
  }
  return shards;
}

Status AddTensors(const fs::path& file, std::vector<std::pair<std::string, Value>> tensors,
                  const std::set<std::string>* indexed, HfFolder* folder) {
  for (auto& [name, tensor] : tensors) {
    if (indexed != nullptr && !indexed->count(name)) {
      return Status::InvalidInput(file.string() + " holds " + name + ", which the weight index does not place "
                                  "there; the index and the shards are of different saves");
    }
    if (!folder->tensors.emplace(name, std::move(tensor)).second) {
      return Status::InvalidInput(name + " is in two weight files of " + folder->dir + "; keep one save per folder");
    }
    folder->order.push_back(name);
  }
  if (indexed == nullptr) return Status::Ok();
  for (const std::string& name : *indexed) {
    if (!folder->tensors.count(name)) {
      return Status::InvalidInput("the weight index places " + name + " in " + file.string() +
                                  ", which does not hold it; the shard is incomplete");
    }
  }
  return Status::Ok();
}

Status ReadWeights(const fs::path& dir, HfFolder* folder) {
  for (const auto& [single, index] : kWeightNames) {
    if (Exists(dir / index)) {
      RESHARD_ASSIGN_OR_RETURN(auto shards, ReadIndex(dir / index));
      folder->files.push_back((dir / index).string());
      for (const auto& [shard, names] : shards) {
        RESHARD_ASSIGN_OR_RETURN(auto tensors, ReadWeightFile(dir / shard));
        folder->files.push_back((dir / shard).string());
        RESHARD_RETURN_IF_ERROR(AddTensors(dir / shard, std::move(tensors), &names, folder));
      }
      return Status::Ok();
    }
    if (Exists(dir / single)) {
      RESHARD_ASSIGN_OR_RETURN(auto tensors, ReadWeightFile(dir / single));
      folder->files.push_back((dir / single).string());
      return AddTensors(dir / single, std::move(tensors), nullptr, folder);
    }
  }
  return Status::InvalidInput(dir.string() + " has config.json but no weights (model.safetensors, "
                              "model.safetensors.index.json, pytorch_model.bin or its index)");
}

bool HoldsWeights(const fs::path& dir) {
  for (const auto& [single, index] : kWeightNames) {
    if (Exists(dir / single) || Exists(dir / index)) return true;
  }
  return false;
}

}  // namespace

Result<Value> ReadJsonFile(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path));
  return ParseJson(text, path);
}

bool IsHfFolder(const std::string& path) {
  const fs::path dir(path);
  // An HF Trainer checkpoint-N/ folder has both: its DeepSpeed checkpoint
  // (named by `latest`) is what a DeepSpeed tool is asked to read.
  return Exists(dir / kConfig) && !Exists(dir / "latest") && HoldsWeights(dir);
}

bool IsWeightsWithoutConfig(const std::string& path) {
  const fs::path dir(path);
  return !Exists(dir / kConfig) && !Exists(dir / "latest") && HoldsWeights(dir);
}

Result<HfFolder> ReadHfFolder(const std::string& dir) {
  HfFolder folder;
  folder.dir = dir;
  RESHARD_ASSIGN_OR_RETURN(folder.config, ReadJsonFile((fs::path(dir) / kConfig).string()));
  if (!folder.config.is(Value::Kind::kDict)) {
    return Status::InvalidInput((fs::path(dir) / kConfig).string() + " does not hold a JSON object");
  }
  folder.files.push_back((fs::path(dir) / kConfig).string());
  RESHARD_RETURN_IF_ERROR(ReadWeights(dir, &folder));
  if (folder.tensors.empty()) return Status::InvalidInput(dir + "'s weight files hold no tensors");
  return folder;
}

Result<HfFolder> ReadWeightsWithoutConfig(const std::string& dir) {
  HfFolder folder;
  folder.dir = dir;
  RESHARD_RETURN_IF_ERROR(ReadWeights(dir, &folder));
  if (folder.tensors.empty()) return Status::InvalidInput(dir + "'s weight files hold no tensors");
  return folder;
}

}  // namespace reshard
