#include "formats/accelerate/accelerate_import.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <regex>

#include "container/torch_file.h"
#include "formats/dcp_common/dcp_content.h"
#include "formats/hf_common/hf_folder.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kFullModelFile[] = "pytorch_model_fsdp.bin";
constexpr char kFullOptimizerFile[] = "optimizer.bin";
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

constexpr char kModelPrefix[] = "model.";
constexpr char kGroups[] = "optimizer.param_groups.";
constexpr char kParams[] = ".params";
constexpr char kParamNames[] = ".param_names";
// A bound on the states the split of the parameters among the groups visits.
constexpr int64_t kMostSplitStates = int64_t{1} << 22;

using Shape = std::vector<int64_t>;

// The start of every refusal of an index-keyed optimizer state.
std::string IndexKeyed(const std::string& folder) {
  return "the Accelerate FSDP2 checkpoint " + folder + "'s optimizer state is keyed by parameter index (" +
         kOptimizerState + "<i>), and ";
}
// The end of those the save could have avoided.
constexpr char kIndexFix[] =
    "; build the optimizer from model.named_parameters() (torch then records each group's param_names), or pass "
    "--weights-only to read the model";

// The param groups of an optimizer's own state_dict(): each group's indices,
// and its param_names where torch recorded them for every group.
struct SavedGroups {
  std::vector<std::vector<int64_t>> indices;
  std::vector<std::vector<std::string>> names;
};

// A list of `kind` items of `value` as strings or ints, by `convert`.
template <typename T>
Result<std::vector<T>> ListOf(const Value& value, Value::Kind kind, T (*convert)(const Value&)) {
  std::vector<T> out;
  if (!value.is(Value::Kind::kList)) return Status::InvalidInput("no list");
  for (const Value& v : value.as_list().items) {
    if (!v.is(kind)) return Status::InvalidInput("holds " + v.DebugString(40));
    out.push_back(convert(v));
  }
  return out;
}
int64_t AsInt(const Value& v) { return v.as_int(); }
std::string AsString(const Value& v) { return v.as_string(); }

// A torch.save file of the FULL_STATE_DICT form, its tensors plain: FSDP1
// marks each `_has_been_cloned`, FSDP2's are whole DTensors.
Result<Value> ReadFullFile(const std::string& path) {
  PickleReadOptions read;
  read.dropped_tensor_attributes = {"_has_been_cloned"};
  return ReadTorchFile(path, read);
}

// What an index-keyed optimizer state's mapping is read from, in either form
// of the save: the model's tensors (`model.` stripped) in its state dict's
// order, each index's state shape (its moments'), and the optimizer's
// objects by their flattened keys.
struct IndexSources {
  std::string folder;
  std::vector<std::pair<std::string, Shape>> model;
  std::map<int64_t, Shape> state_shapes;
  std::function<bool(const std::string& key)> has_object;
  std::function<Result<Value>(const std::string& key)> read_object;
};

// The groups of `sources` when their params are indices; nullopt when they
// are FQNs (FSDP1's optim_state_dict) or absent.
Result<std::optional<SavedGroups>> IndexedGroups(const IndexSources& sources) {
  SavedGroups out;
  bool named = true;
  for (int64_t g = 0; sources.has_object(kGroups + std::to_string(g) + kParams); ++g) {
    const std::string group = kGroups + std::to_string(g);
    RESHARD_ASSIGN_OR_RETURN(Value params, sources.read_object(group + kParams));
    const bool fqns = params.is(Value::Kind::kList) && !params.as_list().items.empty() &&
                      params.as_list().items.front().is(Value::Kind::kString);
    if (fqns) return std::optional<SavedGroups>();
    Result<std::vector<int64_t>> indices = ListOf(params, Value::Kind::kInt, AsInt);
    if (!indices.ok()) {
      return Status::InvalidInput(sources.folder + "'s " + group + kParams + " is no list of parameter indices or "
                                  "names (" + indices.status().message() + ")");
    }
    out.indices.push_back(std::move(*indices));
    std::vector<std::string> names;
    if (sources.has_object(group + kParamNames)) {
      RESHARD_ASSIGN_OR_RETURN(Value listed, sources.read_object(group + kParamNames));
      Result<std::vector<std::string>> strings = ListOf(listed, Value::Kind::kString, AsString);
      if (strings.ok() && strings->size() == out.indices.back().size()) names = std::move(*strings);
    }
    named = named && !names.empty();
    out.names.push_back(std::move(names));
  }
  if (out.indices.empty()) return std::optional<SavedGroups>();
  if (!named) out.names.clear();
  return std::optional<SavedGroups>(std::move(out));
}

// Each index's state shape, from the optimizer's tensors (key, shape).
std::map<int64_t, Shape> StateShapes(const std::vector<std::pair<std::string, Shape>>& tensors) {
  std::map<int64_t, Shape> out;
  for (const auto& [key, shape] : tensors) {
    if (!StartsWith(key, kOptimizerState) || shape.empty()) continue;
    const std::string rest = key.substr(sizeof(kOptimizerState) - 1);
    int64_t index = 0;
    if (ParseInt(rest.substr(0, rest.find('.')), &index)) out.emplace(index, shape);
  }
  return out;
}

// The model's tensors of `tensors` (key, shape), `model.` stripped.
std::vector<std::pair<std::string, Shape>> ModelTensors(const std::vector<std::pair<std::string, Shape>>& tensors) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& [key, shape] : tensors) {
    if (StartsWith(key, kModelPrefix)) out.emplace_back(key.substr(sizeof(kModelPrefix) - 1), shape);
  }
  return out;
}

// The tensors of a DCP folder (key, shape) in the order of its metadata,
// which torch's save keeps in the order of the state dict: the first rank
// holds the first rows of every FSDP2 parameter, and lists them in order.
std::vector<std::pair<std::string, Shape>> OrderedTensors(const DcpContent& content) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const std::string& key : content.meta.order) {
    const DcpItem& item = content.meta.items.at(key);
    if (item.kind == DcpItem::Kind::kTensor) out.emplace_back(key, item.size);
  }
  return out;
}

// The ways to deal the model's parameters (their shapes, in the module's
// order) out to the param groups (their members' shapes, in index order),
// each group taking its members in the module's order, shape for shape:
// Count() says whether none, one or more fit, Owners() gives the one.
class GroupSplit {
 public:
  GroupSplit(std::vector<Shape> params, std::vector<std::vector<Shape>> groups)
      : params_(std::move(params)), groups_(std::move(groups)) {}

  // 0, 1, or 2 for more than one.
  int Count() { return CountFrom(std::vector<size_t>(groups_.size(), 0)); }

  // The group of each parameter, in the one split Count() found.
  std::vector<size_t> Owners() {
    std::vector<size_t> pos(groups_.size(), 0), owners;
    for (size_t p = 0; p < params_.size(); ++p) {
      for (size_t g = 0; g < groups_.size(); ++g) {
        if (!Takes(pos, g, p)) continue;
        ++pos[g];
        if (CountFrom(pos) > 0) {
          owners.push_back(g);
          break;
        }
        --pos[g];
      }
    }
    return owners;
  }

  // How many states the count may visit: the product of the groups' sizes + 1.
  int64_t States() const {
    int64_t states = 1;
    for (const auto& g : groups_) states = std::min(kMostSplitStates + 1, states * static_cast<int64_t>(g.size() + 1));
    return states;
  }

 private:
  bool Takes(const std::vector<size_t>& pos, size_t g, size_t p) const {
    return pos[g] < groups_[g].size() && groups_[g][pos[g]] == params_[p];
  }

  int CountFrom(std::vector<size_t> pos) {
    size_t p = 0;
    for (size_t taken : pos) p += taken;
    if (p == params_.size()) return 1;
    auto memo = counts_.find(pos);
    if (memo != counts_.end()) return memo->second;
    int count = 0;
    for (size_t g = 0; g < groups_.size() && count < 2; ++g) {
      if (!Takes(pos, g, p)) continue;
      ++pos[g];
      count = std::min(2, count + CountFrom(pos));
      --pos[g];
    }
    counts_.emplace(std::move(pos), count);
    return count;
  }

  const std::vector<Shape> params_;
  const std::vector<std::vector<Shape>> groups_;
  std::map<std::vector<size_t>, int> counts_;
};

// The FQN of each index from the order of the model's state dict.
Result<std::vector<std::string>> FqnsByModelOrder(const IndexSources& sources, const SavedGroups& groups,
                                                  int64_t count) {
  const std::string& folder = sources.folder;
  const std::vector<std::pair<std::string, Shape>>& tensors = sources.model;
  if (static_cast<int64_t>(tensors.size()) != count) {
    return Status::Unsupported(IndexKeyed(folder) + "holds " + std::to_string(count) + " parameters where the "
                               "model's state dict holds " + std::to_string(tensors.size()) + " tensors: which of "
                               "them have no index (a tied copy, a buffer, a frozen parameter) is not recorded" +
                               kIndexFix);
  }
  const std::map<int64_t, Shape>& shapes = sources.state_shapes;
  std::vector<Shape> params;
  for (const auto& t : tensors) params.push_back(t.second);
  std::vector<std::vector<Shape>> members;
  for (const std::vector<int64_t>& group : groups.indices) {
    members.emplace_back();
    for (int64_t i : group) {
      auto it = shapes.find(i);
      if (it == shapes.end()) {
        return Status::InvalidInput(IndexKeyed(folder) + "parameter " + std::to_string(i) + " has no state (" +
                                    kOptimizerState + std::to_string(i) + ".exp_avg), whose shape tells which it "
                                    "is; pass --weights-only to read the model");
      }
      members.back().push_back(it->second);
    }
  }
  GroupSplit split(params, members);
  if (split.States() > kMostSplitStates) {
    return Status::Unsupported(IndexKeyed(folder) + "its " + std::to_string(groups.indices.size()) + " param "
                               "groups are too many to tell by their states' shapes which parameters each holds" +
                               kIndexFix);
  }
  const int fits = split.Count();
  if (fits != 1) {
    return Status::Unsupported(IndexKeyed(folder) + "the shapes of its states fit " +
                               (fits == 0 ? std::string("no") : std::string("more than one")) + " dealing of the "
                               "model's parameters, in its state dict's order, to its " +
                               std::to_string(groups.indices.size()) + " param groups (each listing its own in the "
                               "module's order)" + kIndexFix);
  }
  std::vector<std::string> fqns(count);
  std::vector<size_t> taken(groups.indices.size(), 0);
  const std::vector<size_t> owners = split.Owners();
  for (size_t p = 0; p < owners.size(); ++p) {
    fqns[groups.indices[owners[p]][taken[owners[p]]++]] = tensors[p].first;
  }
  return fqns;
}

// The sharded form's sources: the model's and the optimizer's DCP folders'
// metadata; nullopt without optimizer_0/.
Result<std::optional<IndexSources>> ShardedIndexSources(const std::string& folder) {
  const std::string optim_folder = folder + "/" + kAccelerateOptimizerFolder;
  if (!IsDirectory(optim_folder)) return std::optional<IndexSources>();
  RESHARD_ASSIGN_OR_RETURN(DcpContent read, ReadDcpContent(optim_folder));
  auto optim = std::make_shared<const DcpContent>(std::move(read));
  RESHARD_ASSIGN_OR_RETURN(const DcpContent model, ReadDcpContent(folder + "/" + kAccelerateModelFolder));
  IndexSources out;
  out.folder = folder;
  out.model = ModelTensors(OrderedTensors(model));
  out.state_shapes = StateShapes(OrderedTensors(*optim));
  out.has_object = [optim](const std::string& key) { return optim->meta.items.count(key) > 0; };
  out.read_object = [optim](const std::string& key) { return optim->ReadBytes(key); };
  return std::optional<IndexSources>(std::move(out));
}

// The FULL_STATE_DICT form's sources: pytorch_model_fsdp.bin's tensors in
// its order, optimizer.bin's states and objects; nullopt without optimizer.bin.
Result<std::optional<IndexSources>> FullIndexSources(const std::string& folder) {
  if (!Exists(fs::path(folder) / kFullOptimizerFile)) return std::optional<IndexSources>();
  RESHARD_ASSIGN_OR_RETURN(const Value model, ReadFullFile(folder + "/" + kFullModelFile));
  RESHARD_ASSIGN_OR_RETURN(DcpTensors read, ReadAccelerateFullStateDict(folder));
  auto whole = std::make_shared<const DcpTensors>(std::move(read));
  IndexSources out;
  out.folder = folder;
  std::vector<std::pair<std::string, Shape>> optimizer;
  for (const auto& [key, t] : whole->tensors) optimizer.emplace_back(key, t.tensor.as_tensor().sizes);
  out.state_shapes = StateShapes(optimizer);
  for (const auto& [key, value] : *DictItems(model)) {  // ReadAccelerateFullStateDict found it a dict
    if (key.is(Value::Kind::kString) && value.is(Value::Kind::kTensor)) {
      out.model.emplace_back(key.as_string(), value.as_tensor().sizes);
    }
  }
  out.has_object = [whole](const std::string& key) {
    return std::find(whole->objects.begin(), whole->objects.end(), key) != whole->objects.end();
  };
  out.read_object = [whole](const std::string& key) { return whole->read_object(key); };
  return std::optional<IndexSources>(std::move(out));
}

}  // namespace

Result<std::optional<AccelerateParamIndex>> ReadAccelerateParamIndex(const std::string& folder) {
  RESHARD_ASSIGN_OR_RETURN(const std::optional<IndexSources> sources,
                           IsAccelerateFullStateDict(folder) ? FullIndexSources(folder) : ShardedIndexSources(folder));
  if (!sources) return std::optional<AccelerateParamIndex>();
  RESHARD_ASSIGN_OR_RETURN(std::optional<SavedGroups> groups, IndexedGroups(*sources));
  if (!groups) return std::optional<AccelerateParamIndex>();
  AccelerateParamIndex out;
  out.groups = groups->indices;
  int64_t count = 0;  // torch numbers the groups' parameters in order
  for (const std::vector<int64_t>& group : groups->indices) {
    for (int64_t i : group) {
      if (i != count++) {
        return Status::InvalidInput(IndexKeyed(folder) + "its param groups do not number their parameters 0, 1, "
                                    "... in order, as torch's state_dict() does; restore the file Accelerate saved");
      }
    }
  }
  if (!groups->names.empty()) {
    for (const std::vector<std::string>& names : groups->names) {
      for (const std::string& name : names) {
        const bool held = std::any_of(sources->model.begin(), sources->model.end(),
                                      [&name](const auto& tensor) { return tensor.first == name; });
        if (!held) {
          return Status::InvalidInput(IndexKeyed(folder) + "its param_names name " + name + ", which its model "
                                      "does not hold (" + kModelPrefix + name + "); restore the files Accelerate saved");
        }
        out.fqns.push_back(name);
      }
    }
    return std::optional<AccelerateParamIndex>(std::move(out));
  }
  RESHARD_ASSIGN_OR_RETURN(out.fqns, FqnsByModelOrder(*sources, *groups, count));
  return std::optional<AccelerateParamIndex>(std::move(out));
}

namespace {

// `dcp` with its index-keyed optimizer state keyed by FQN, as FSDP1's is:
// `optimizer.state.<fqn>.*`, and each group's params its FQNs.
DcpTensors KeyedByFqn(const DcpTensors& dcp, const AccelerateParamIndex& index) {
  auto renamed = [&index](const std::string& key) {
    if (!StartsWith(key, kOptimizerState)) return key;
    const std::string rest = key.substr(sizeof(kOptimizerState) - 1);
    const size_t dot = rest.find('.');
    int64_t i = 0;
    if (dot == std::string::npos || !ParseInt(rest.substr(0, dot), &i) || i < 0 ||
        i >= static_cast<int64_t>(index.fqns.size())) {
      return key;
    }
    return kOptimizerState + index.fqns[i] + rest.substr(dot);
  };
  DcpTensors out = dcp;
  out.tensors.clear();
  out.chunks.clear();
  for (const auto& [key, t] : dcp.tensors) out.tensors.emplace(renamed(key), t);
  for (const auto& [key, chunks] : dcp.chunks) out.chunks.emplace(renamed(key), chunks);
  // param_names is no hyperparameter: the groups' params now name them.
  out.objects.erase(std::remove_if(out.objects.begin(), out.objects.end(),
                                   [](const std::string& key) {
                                     return StartsWith(key, kGroups) && EndsWith(key, kParamNames);
                                   }),
                    out.objects.end());
  out.read_object = [read = dcp.read_object, index](const std::string& key) -> Result<Value> {
    int64_t g = 0;
    const bool params = StartsWith(key, kGroups) && EndsWith(key, kParams) &&
                        ParseInt(key.substr(sizeof(kGroups) - 1, key.size() - (sizeof(kGroups) - 1) -
                                                                      (sizeof(kParams) - 1)),
                                 &g) &&
                        g >= 0 && g < static_cast<int64_t>(index.groups.size());
    if (!params) return read(key);
    std::vector<Value> fqns;
    for (int64_t i : index.groups[g]) fqns.push_back(Value::String(index.fqns[i]));
    return Value::MakeList(std::move(fqns));
  };
  return out;
}

}  // namespace

std::vector<std::string> AccelerateRunFiles(const std::string& folder) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != kAccelerateModelFolder && name != kAccelerateOptimizerFolder && name != kConfig && name != kManifest &&
        name != kFullModelFile && name != kFullOptimizerFile) {
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
  return IsDirectory(folder) && Exists(folder / kFullModelFile) ? folder.string() : std::string();
}

bool IsAccelerateFullStateDict(const std::string& folder) {
  return !IsDirectory(fs::path(folder) / kAccelerateModelFolder) && Exists(fs::path(folder) / kFullModelFile);
}

namespace {

// Adds `value`'s items under `prefix` to `out`, as torch's DCP flattens a
// state dict: a dict's or a list's items by key or index, a tensor as a
// tensor, anything else (a hyperparameter, a list of FQNs) as an object.
void Flatten(const std::string& prefix, const Value& value, DcpTensors* out, std::map<std::string, Value>* objects) {
  const Items* items = DictItems(value);
  const bool nested_list = value.is(Value::Kind::kList) &&
                           std::any_of(value.as_list().items.begin(), value.as_list().items.end(),
                                       [](const Value& v) { return DictItems(v) != nullptr; });
  if (items != nullptr) {
    for (const auto& [key, item] : *items) {
      const std::string name = key.is(Value::Kind::kString) ? key.as_string()
                               : key.is(Value::Kind::kInt)  ? std::to_string(key.as_int())
                                                            : key.DebugString(40);
      Flatten(prefix + "." + name, item, out, objects);
    }
  } else if (nested_list) {
    for (size_t i = 0; i < value.as_list().items.size(); ++i) {
      Flatten(prefix + "." + std::to_string(i), value.as_list().items[i], out, objects);
    }
  } else if (value.is(Value::Kind::kTensor)) {
    out->tensors[prefix] = ImportedTensor{value, SourceShard::Of(value.as_tensor(), {})};
  } else {
    out->objects.push_back(prefix);
    (*objects)[prefix] = value;
  }
}

}  // namespace

Result<DcpTensors> ReadAccelerateFullStateDict(const std::string& folder) {
  DcpTensors out;
  out.folder = folder;
  auto objects = std::make_shared<std::map<std::string, Value>>();
  for (const auto& [file, prefix] : {std::pair<const char*, const char*>{kFullModelFile, "model"},
                                     {kFullOptimizerFile, "optimizer"}}) {
    const std::string path = folder + "/" + file;
    if (!Exists(path)) continue;
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadFullFile(path));
    if (DictItems(root) == nullptr) {
      return Status::InvalidInput(path + " holds " + root.DebugString(60) + ", not the state dict Accelerate's "
                                  "FULL_STATE_DICT save writes; restore the file Accelerate saved");
    }
    out.files.push_back(path);
    Flatten(prefix, root, &out, objects.get());
  }
  out.read_object = [objects](const std::string& key) -> Result<Value> {
    auto it = objects->find(key);
    if (it == objects->end()) return Status::Internal("no object " + key + " in the FULL_STATE_DICT save");
    return it->second;
  };
  return out;
}

std::map<std::string, std::string> AccelerateSaveOptions(const DcpTensors& dcp) {
  // An index-keyed state's groups list indices; FSDP1's list FQNs.
  const bool indexed = dcp.read_object && [&dcp] {
    Result<Value> params = dcp.read_object(std::string(kGroups) + "0" + kParams);
    return params.ok() && params->is(Value::Kind::kList) && !params->as_list().items.empty() &&
           params->as_list().items.front().is(Value::Kind::kInt);
  }();
  return {{kFsdpVersionOption, indexed ? "2" : "1"}};
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
  Result<std::optional<AccelerateParamIndex>> index = ReadAccelerateParamIndex(dcp.folder);
  const bool by_fqn = index.ok() && index->has_value();
  Result<StateDictImport> imported = ReadStateDictImport(by_fqn ? KeyedByFqn(dcp, **index) : dcp, keys, options);
  if (!imported.ok()) {
    if (imported.status().code() != Status::Code::kUnsupported) return imported;
    return Status::Unsupported(imported.status().message() + "; the model's family needs a rule file whose hf "
                               "section names its HF model and whose torchtitan section gives its sizes "
                               "(docs/rules.md), given with --rules FILE");
  }
  if (!index.ok()) {  // the model is read; its optimizer state cannot be
    imported->optimizer.reset();
    imported->optimizer_status = index.status();
  }
  if (const std::vector<std::string> run = AccelerateRunFiles(dcp.folder); !run.empty()) {
    imported->notes.push_back("accelerate: " + Join(run, ", ") + " not carried (the Trainer's run state, which "
                              "reshard never unpickles; export --to accelerate copies it, another format has no "
                              "place for it)");
  }
  return imported;
}

}  // namespace reshard
