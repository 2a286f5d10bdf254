#include "formats/deepspeed/universal/universal_reader.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>

#include "formats/deepspeed/files/known_classes.h"
#include "formats/deepspeed/model/stages.h"
#include "util/list_folder.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kStep[] = "step";
constexpr char kOptimizerState[] = "optimizer_state.pt";

// One zero/<param>/ folder: the root of each of its files, by state.
struct ParamFiles {
  std::map<std::string, Value> roots;  // "fp32", "exp_avg", ..., "step"

  // The whole tensor of `state` (its file's 'param'). REQUIRES: checked by ReadParam.
  const Tensor& Whole(const std::string& state) const {
    return Find(roots.at(state), "param")->as_tensor();
  }
};

std::string FilePath(const std::string& param, const std::string& state) {
  return "zero/" + param + "/" + state + ".pt";
}

// Reads every file of the folder of `param`, checking that each state is an
// fp32 tensor shaped like the master.
Result<ParamFiles> ReadParam(const fs::path& folder, const std::string& param,
                             const std::set<std::string>& allowed, std::vector<std::string>* files) {
  ParamFiles p;
  RESHARD_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListFolder(folder.string()));
  for (const fs::directory_entry& entry : entries) {
    const std::string name = entry.path().filename().string();
    std::error_code ec;
    if (!entry.is_regular_file(ec) || name.size() < 4 || name.substr(name.size() - 3) != ".pt") {
      return Status::InvalidInput("zero/" + param + "/" + name + " is not a state file (<state>.pt) of a "
                                  "universal checkpoint; move it out of " + folder.parent_path().string());
    }
    files->push_back(entry.path().string());
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(entry.path().string(), allowed));
    p.roots.emplace(name.substr(0, name.size() - 3), std::move(root));
  }
  if (!p.roots.count(kMasterState)) {
    return Status::InvalidInput("zero/" + param + " has no fp32.pt; the universal checkpoint is incomplete");
  }
  const Value& master = p.roots.at(kMasterState);
  if (master.is(Value::Kind::kTensor)) {
    return Status::Unsupported(FilePath(param, kMasterState) + " holds a bare tensor without a shape "
                               "(DeepSpeed's universal form of a ZeRO-3 checkpoint); reshard reads the "
                               "ZeRO-1/2 form, {'param': tensor, ...}");
  }
  std::vector<int64_t> shape;
  for (const auto& [state, root] : p.roots) {
    if (state == kStep) continue;
    const Value* t = Find(root, "param");
    if (t == nullptr || !t->is(Value::Kind::kTensor)) {
      return Status::InvalidInput(FilePath(param, state) + " holds no 'param' tensor; it is not a "
                                  "universal checkpoint's state file");
    }
    const Tensor& tensor = t->as_tensor();
    if (tensor.storage->dtype != DType::kFloat32 || !tensor.IsContiguous()) {
      return Status::InvalidInput(FilePath(param, state) + " holds a " + DTypeName(tensor.storage->dtype) +
                                  (tensor.IsContiguous() ? "" : " non-contiguous") +
                                  " tensor; universal checkpoints keep contiguous fp32 states");
    }
    if (state == kMasterState) shape = tensor.sizes;
  }
  for (const auto& [state, root] : p.roots) {
    if (state != kStep && p.Whole(state).sizes != shape) {
      return Status::InvalidInput(FilePath(param, state) + " is " + ShapeString(p.Whole(state).sizes) +
                                  " but fp32.pt is " + ShapeString(shape) + "; the universal checkpoint mixes parameters");
    }
  }
  return p;
}

// Where a parameter name puts the tensor: `<spec id>.<key>`, or
// `tied_modules.<module>.<key>` (id -1).
struct Place {
  int id = -1;
  std::string tied_module;
  std::string key;
};

bool ParsePlace(const std::string& name, Place* place) {
  const std::string tied = "tied_modules.";
  if (name.rfind(tied, 0) == 0) {
    const size_t dot = name.find('.', tied.size());
    if (dot == std::string::npos || dot == tied.size() || dot + 1 == name.size()) return false;
    place->tied_module = name.substr(tied.size(), dot - tied.size());
    place->key = name.substr(dot + 1);
    return true;
  }
  const size_t dot = name.find('.');
  if (dot == std::string::npos || dot == 0 || dot > 6 || dot + 1 == name.size()) return false;
  for (size_t i = 0; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  place->id = std::stoi(name.substr(0, dot));
  place->key = name.substr(dot + 1);
  return true;
}

// The parameters the mp_rank files record (param_shapes), each once.
struct RecordedParams {
  // The order DeepSpeed registered them in: every stage's groups in turn.
  // Keys placed in that order keep every group's order, which is what the
  // target's flat groups are built from.
  std::map<std::string, size_t> order;
  std::map<std::string, std::vector<int64_t>> shapes;  // TP-local, as the source stored them
};

RecordedParams ReadRecordedParams(const std::vector<Value>& metadata) {
  RecordedParams recorded;
  for (const Value& m : metadata) {
    std::vector<std::vector<ParamShape>> groups;
    if (!ReadParamShapes(m, &groups)) continue;
    for (const auto& group : groups) {
      for (const ParamShape& p : group) {
        recorded.order.emplace(p.first, recorded.order.size());
        recorded.shapes.emplace(p.first, p.second);
      }
    }
  }
  return recorded;
}

// The dtype DeepSpeed trained the weights in: Megatron's args, else the
// DeepSpeed config.
DType TrainingDType(const Value& metadata) {
  auto enabled = [](const Value* v) { return v != nullptr && v->is(Value::Kind::kBool) && v->as_bool(); };
  const Value* args = Find(metadata, "args");
  if (args != nullptr && (Find(*args, "bf16") != nullptr || Find(*args, "fp16") != nullptr)) {
    if (enabled(Find(*args, "bf16"))) return DType::kBFloat16;
    if (enabled(Find(*args, "fp16"))) return DType::kFloat16;
    return DType::kFloat32;
  }
  const Value* config = Find(metadata, "ds_config");
  for (const auto& [key, dtype] : {std::pair{"bf16", DType::kBFloat16}, std::pair{"fp16", DType::kFloat16}}) {
    const Value* section = config != nullptr ? Find(*config, key) : nullptr;
    if (section != nullptr && enabled(Find(*section, "enabled"))) return dtype;
  }
  return DType::kFloat32;
}

// A universal checkpoint's optimizer state, located in its per-parameter files.
class UniversalOptimizer : public SourceOptimizer {
 public:
  static Result<std::unique_ptr<SourceOptimizer>> Make(std::map<std::string, ParamFiles> params,
                                                       const Value& optimizer_state, const Value& metadata,
                                                       DType training_dtype);

  const OptimizerFormat& format() const override { return format_; }
  const std::vector<std::string>& states() const override { return states_; }
  const std::vector<std::string>& scalar_states() const override { return scalars_; }
  int num_groups() const override { return num_groups_; }
  int tp() const override { return 1; }
  const Value& Template() const override { return template_; }
  std::vector<std::string> ParamNames() const override {
    std::vector<std::string> names;
    for (const auto& [name, files] : params_) names.push_back(name);
    return names;
  }
  bool Has(const std::string& name) const override { return params_.count(name) > 0; }
  Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const override {
    auto it = params_.find(name);
    if (it == params_.end() || t != 0 || !it->second.roots.count(state)) {
      return Status::InvalidInput("the universal checkpoint has no " + FilePath(name, state));
    }
    return SourceShard::Of(it->second.Whole(state), ShardCoords{});
  }

 private:
  Status MakeTemplate(const Value& optimizer_state, const Value& metadata, const Value* step);

  OptimizerFormat format_;
  std::vector<std::string> states_;  // kMasterState, then the others by name
  std::vector<std::string> scalars_;
  int num_groups_ = 0;
  Value template_;
  std::map<std::string, ParamFiles> params_;  // the files the states lie in
};

// The states every parameter has: fp32 first, the others by name (Adam's
// exp_avg, exp_avg_sq: the order torch keeps them in).
Result<std::vector<std::string>> CommonStates(const std::map<std::string, ParamFiles>& params) {
  std::vector<std::string> states = {kMasterState};
  const auto& [first_name, first] = *params.begin();
  for (const auto& [state, root] : first.roots) {
    if (state != kMasterState && state != kStep) states.push_back(state);
  }
  const bool step = first.roots.count(kStep) > 0;
  for (const auto& [name, p] : params) {
    for (const std::string& state : states) {
      if (!p.roots.count(state)) {
        return Status::InvalidInput("zero/" + name + " has no " + state + ".pt, which zero/" + first_name +
                                    " has; the universal checkpoint is incomplete");
      }
    }
    if (p.roots.size() != states.size() + (step ? 1 : 0)) {
      return Status::InvalidInput("zero/" + name + " holds other state files than zero/" + first_name +
                                  " (" + Join(states, ", ") + (step ? ", step" : "") + ")");
    }
  }
  return states;
}

Result<std::unique_ptr<SourceOptimizer>> UniversalOptimizer::Make(std::map<std::string, ParamFiles> params,
                                                                  const Value& optimizer_state,
                                                                  const Value& metadata, DType training_dtype) {
  auto opt = std::make_unique<UniversalOptimizer>();
  RESHARD_ASSIGN_OR_RETURN(opt->states_, CommonStates(params));
  opt->params_ = std::move(params);
  const Value* step = nullptr;
  for (const auto& [name, p] : opt->params_) {
    auto it = p.roots.find(kStep);
    if (it == p.roots.end()) continue;
    if (step != nullptr && step->DebugString(64) != it->second.DebugString(64)) {
      return Status::InvalidInput(FilePath(name, kStep) + " records step " + it->second.DebugString(64) +
                                  " but others " + step->DebugString(64) +
                                  "; the universal checkpoint mixes saves");
    }
    step = &it->second;
  }
  // DeepSpeedZeroOptimizer records its stage; BF16_Optimizer does not.
  opt->format_.zero = Find(optimizer_state, "zero_stage") != nullptr;
  // DeepSpeed 0.6.5's spelling, from before it recorded param_slice_mappings.
  if (Find(optimizer_state, "groups_padding") != nullptr) opt->format_.padding_key = "groups_padding";
  opt->format_.slice_mappings = opt->format_.padding_key == "group_paddings";
  opt->format_.bf16_prefix = training_dtype == DType::kBFloat16;
  RESHARD_RETURN_IF_ERROR(opt->MakeTemplate(optimizer_state, metadata, step));
  return std::unique_ptr<SourceOptimizer>(std::move(opt));
}

// The template every target shard is built from (zero_shard_writer.h fills
// in the partitions): zero/optimizer_state.pt's entries, with a
// base_optimizer_state of its param_groups and one state per group (the
// step, where the groups do not record it, and the per-element states), and
// the mp_rank files' ds_config and ds_version beside it.
Status UniversalOptimizer::MakeTemplate(const Value& optimizer_state, const Value& metadata, const Value* step) {
  const Value* groups = Find(optimizer_state, "param_groups");
  if (groups == nullptr || !groups->is(Value::Kind::kList) || groups->as_list().items.empty()) {
    return Status::InvalidInput("zero/optimizer_state.pt has no param_groups; it is not a universal "
                                "checkpoint's optimizer state");
  }
  num_groups_ = static_cast<int>(groups->as_list().items.size());
  const bool step_in_groups = Find(groups->as_list().items[0], kStep) != nullptr;
  Items per_group;
  for (int g = 0; g < num_groups_; ++g) {
    Items state;
    if (step != nullptr && !step_in_groups) state.emplace_back(Value::String(kStep), *step);
    for (size_t s = 1; s < states_.size(); ++s) state.emplace_back(Value::String(states_[s]), Value::None());
    per_group.emplace_back(Value::Int(g), Value::MakeDict(std::move(state)));
  }
  Value base = Value::MakeDict({{Value::String("state"), Value::MakeDict(std::move(per_group))},
                                {Value::String("param_groups"), *groups}});
  const std::string& first = params_.begin()->first;
  Value mappings = Value::MakeList(
      {MakeOrderedDict({{Value::String(first), FragmentAddress(params_.begin()->second.Whole(kMasterState).numel(), 0)}})});
  // Where DeepSpeed puts them: after clip_grad.
  Value osd = Value::MakeDict();
  auto add_partitions = [&] {
    Set(osd, "base_optimizer_state", base);
    Set(osd, "single_partition_of_fp32_groups", Value::MakeList({}));
  };
  const bool has_clip = Find(optimizer_state, "clip_grad") != nullptr;
  if (!has_clip) add_partitions();
  for (const auto& [key, value] : *DictItems(optimizer_state)) {
    if (!key.is(Value::Kind::kString) || key.as_string() == "param_groups") continue;
    Set(osd, key.as_string(), value);
    if (key.as_string() == "clip_grad") add_partitions();
  }
  if (format_.slice_mappings) Set(osd, "param_slice_mappings", std::move(mappings));
  template_ = Value::MakeDict({{Value::String("optimizer_state_dict"), std::move(osd)}});
  for (const char* key : {"ds_config", "ds_version"}) {
    if (const Value* v = Find(metadata, key)) Set(template_, key, *v);
  }
  return Status::Ok();
}

// The tensors of the checkpoint placed in layers: numbered ones by their
// spec id, tied ones (`tied`, in one layer) once their id is known.
struct Layers {
  std::map<int, Items> numbered;
  Items tied;
  std::string tied_module;
};

Result<Layers> PlaceTensors(const std::map<std::string, ParamFiles>& params,
                            const std::map<std::string, size_t>& order) {
  std::vector<std::pair<size_t, std::string>> names;  // registration order, unknown names last
  for (const auto& [name, p] : params) names.emplace_back(order.count(name) ? order.at(name) : order.size(), name);
  std::stable_sort(names.begin(), names.end());
  Layers layers;
  for (const auto& [position, name] : names) {
    Place place;
    if (!ParsePlace(name, &place)) {
      return Status::Unsupported("zero/" + name + " is not a pipeline parameter name (<spec id>.<key> or "
                                 "tied_modules.<module>.<key>); reshard reads universal checkpoints of "
                                 "Megatron-DeepSpeed pipeline models");
    }
    Value tensor = Value::MakeTensor(params.at(name).Whole(kMasterState));
    if (place.id >= 0) {
      layers.numbered[place.id].emplace_back(Value::String(place.key), std::move(tensor));
      continue;
    }
    if (!layers.tied_module.empty() && layers.tied_module != place.tied_module) {
      return Status::Unsupported("the universal checkpoint ties two modules (" + layers.tied_module + ", " +
                                 place.tied_module + "); reshard's rules tie one");
    }
    layers.tied_module = place.tied_module;
    layers.tied.emplace_back(Value::String(place.key), std::move(tensor));
  }
  return layers;
}

LogicalLayer MakeLayer(int id, Items items) {
  LogicalLayer layer;
  layer.id = id;
  layer.label = "zero/" + std::to_string(id);
  layer.roots.push_back(MakeOrderedDict(std::move(items)));
  return layer;
}

// A rule's place in its layer's rule list (the list's size when none).
size_t RuleIndex(const RuleSet& rules, const ParamRule* rule) {
  const auto role = rule == nullptr ? rules.layers().end() : rules.layers().find(rule->role);
  if (role == rules.layers().end()) return SIZE_MAX;
  for (size_t i = 0; i < role->second.size(); ++i) {
    if (&role->second[i] == rule) return i;
  }
  return role->second.size();
}

// DeepSpeed writes a layer file's keys in module order (the module's
// state_dict), and so must a conversion. The universal tag does not have
// it: its param_shapes list the keys by optimizer group (the decayed
// weights, then the norms and biases). The rule files list a layer's rules in
// module order, so the keys are sorted by rule, in param_shapes order among
// the keys of one rule; each group keeps its order, which the target's flat
// groups are built from.
void InModuleOrder(LogicalCheckpoint* ckpt) {
  for (LogicalLayer& layer : ckpt->layers) {
    std::stable_sort(layer.tensors.begin(), layer.tensors.end(), [&](const LogicalTensor& a, const LogicalTensor& b) {
      return RuleIndex(*ckpt->rules, a.rule) < RuleIndex(*ckpt->rules, b.rule);
    });
    Items* items = MutableDictItems(layer.roots[0]);
    std::stable_sort(items->begin(), items->end(), [&](const auto& a, const auto& b) {
      auto position = [&](const Value& key) {
        const auto it = std::find_if(layer.tensors.begin(), layer.tensors.end(),
                                     [&](const LogicalTensor& t) { return t.key == key.as_string(); });
        return it - layer.tensors.begin();
      };
      return position(a.first) < position(b.first);
    });
  }
}

// Describes the checkpoint with its tied module at spec `tied_id` (-1: none).
Status DescribeWith(const Layers& layers, int tied_id, const CommonOptions& options, LogicalCheckpoint* ckpt) {
  std::map<int, Items> all = layers.numbered;
  if (tied_id >= 0) all[tied_id] = layers.tied;
  for (auto& [id, items] : all) ckpt->layers.push_back(MakeLayer(id, std::move(items)));
  RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(options.rules, options.set, ckpt));
  InModuleOrder(ckpt);
  if (tied_id >= 0 && ckpt->rules->tied_module() != layers.tied_module) {
    return Status::RuleError("the universal checkpoint ties module '" + layers.tied_module + "' but rule set '" +
                             ckpt->rules->name() + "' ties '" + ckpt->rules->tied_module() + "'");
  }
  return Status::Ok();
}

// The parameter names do not say which spec the tied module belongs to (the
// embedding's, in every Megatron model): it is the one free spec id for
// which a rule set's numbering fits, and there must be exactly one.
Status DescribeLayers(const Layers& layers, const CommonOptions& options, LogicalCheckpoint* ckpt) {
  if (layers.tied.empty()) return DescribeWith(layers, -1, options, ckpt);
  const int last = layers.numbered.empty() ? 0 : layers.numbered.rbegin()->first + 1;
  std::vector<LogicalCheckpoint> fits;
  Status first_error;
  for (int id = 0; id <= last; ++id) {
    if (layers.numbered.count(id)) continue;
    LogicalCheckpoint attempt = *ckpt;
    Status s = DescribeWith(layers, id, options, &attempt);
    if (s.ok()) {
      fits.push_back(std::move(attempt));
    } else if (first_error.ok()) {
      first_error = s;
    }
  }
  if (fits.size() == 1) {
    *ckpt = std::move(fits[0]);
    return Status::Ok();
  }
  if (fits.empty()) return first_error;
  return Status::RuleError("the tied module's spec id is ambiguous: " + std::to_string(fits.size()) +
                           " numberings fit the universal checkpoint; choose the rule set with --rules NAME");
}

// Every parameter the mp_rank files record has a folder.
void CheckComplete(const std::map<std::string, size_t>& order, const std::map<std::string, ParamFiles>& params,
                   LogicalCheckpoint* ckpt) {
  for (const auto& [name, position] : order) {
    if (!params.count(name)) {
      ckpt->AddError("the mp_rank files record parameter " + name + " but zero/" + name +
                     " is missing; the universal checkpoint is incomplete");
    }
  }
}

// The whole tensors agree with the TP-local shapes the mp_rank files record
// (param_shapes) at the TP the checkpoint was made from: the rules' split
// dim times TP, the vocabulary no more rows than its padded ones.
void CheckRecordedShapes(const std::map<std::string, std::vector<int64_t>>& recorded, LogicalCheckpoint* ckpt) {
  const int64_t tp = MetadataInt(ckpt->args(), "tensor_model_parallel_size", -1);
  if (tp < 1) return;
  for (size_t li = 0; li < ckpt->layers.size(); ++li) {
    for (size_t ti = 0; ti < ckpt->layers[li].tensors.size(); ++ti) {
      const LogicalTensor& t = ckpt->layers[li].tensors[ti];
      const std::string name = ParamName(*ckpt, static_cast<int>(li), static_cast<int>(ti));
      auto it = recorded.find(name);
      if (it == recorded.end()) continue;
      std::vector<int64_t> want = it->second;
      const ParamRule& rule = *t.rule;
      if (rule.policy != ParamRule::Policy::kReplicated && rule.dim < static_cast<int>(want.size())) {
        want[rule.dim] *= tp;
      }
      const bool vocab = rule.policy == ParamRule::Policy::kVocab;
      std::vector<int64_t> have = t.full_shape;
      if (vocab && !have.empty() && have.size() == want.size() && have[0] <= want[0]) have[0] = want[0];
      if (have != want) {
        ckpt->AddError("zero/" + name + " is " + ShapeString(t.full_shape) + " but the mp_rank files record " +
                       ShapeString(it->second) + " on each of " + std::to_string(tp) + " TP ranks (" +
                       ShapeString(want) + (vocab ? " with padding" : "") + "); the universal checkpoint does "
                       "not belong to these mp_rank files");
      }
    }
  }
}

}  // namespace

Result<UniversalCheckpoint> ReadUniversalCheckpoint(CheckpointFiles files, const CommonOptions& options) {
  UniversalCheckpoint u;
  u.model = std::make_unique<DeepSpeedModel>();
  DeepSpeedModel& m = *u.model;
  m.files = std::move(files);
  m.universal = true;
  RESHARD_RETURN_IF_ERROR(ReadMetadata(options.allowed_classes, &m));
  LogicalCheckpoint& ckpt = m.logical;
  ckpt.dp = static_cast<int>(std::max<int64_t>(1, MetadataInt(ckpt.metadata[0], "dp_world_size", 1)));

  std::map<std::string, ParamFiles> params;
  std::optional<Value> optimizer_state;
  RESHARD_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListFolder(m.files.universal_dir));
  for (const fs::directory_entry& entry : entries) {
    const std::string name = entry.path().filename().string();
    std::error_code ec;
    if (entry.is_directory(ec)) {
      RESHARD_ASSIGN_OR_RETURN(ParamFiles p,
                               ReadParam(entry.path(), name, options.allowed_classes, &m.files.universal_files));
      params.emplace(name, std::move(p));
    } else if (name == kOptimizerState) {
      m.files.universal_files.push_back(entry.path().string());
      RESHARD_ASSIGN_OR_RETURN(optimizer_state, ReadDeepSpeedFile(entry.path().string(), options.allowed_classes));
      if (DictItems(*optimizer_state) == nullptr) {
        return Status::InvalidInput(entry.path().string() + " does not hold a dict; it is not a universal "
                                    "checkpoint's optimizer state");
      }
    } else {
      ckpt.AddError("unrecognised file 'zero/" + name + "' in " + m.files.tag_dir +
                    "; a universal checkpoint's zero/ holds parameter folders and optimizer_state.pt");
    }
  }
  if (params.empty()) {
    return Status::InvalidInput(m.files.universal_dir + " holds no parameter folders; the universal checkpoint is empty");
  }
  for (const std::string& other : m.files.other_files) {
    ckpt.AddError("unrecognised file '" + other + "' in " + m.files.tag_dir +
                  "; reshard does not know what it holds (move it out of the tag folder if it does not "
                  "belong to the checkpoint)");
  }
  const RecordedParams recorded = ReadRecordedParams(ckpt.metadata);
  const std::map<std::string, size_t>& order = recorded.order;
  RESHARD_ASSIGN_OR_RETURN(Layers layers, PlaceTensors(params, order));
  for (const auto& [name, p] : params) {
    const Value* vocab = Find(p.roots.at(kMasterState), "vocab_tensor");
    ckpt.vocab.padding_stripped |= vocab != nullptr && vocab->is(Value::Kind::kBool) && vocab->as_bool();
  }
  ckpt.weights_from_masters = TrainingDType(ckpt.metadata[0]);
  CheckComplete(order, params, &ckpt);  // before the rules' findings: the more precise line
  RESHARD_RETURN_IF_ERROR(DescribeLayers(layers, options, &ckpt));
  CheckRecordedShapes(recorded.shapes, &ckpt);
  if (optimizer_state) {
    RESHARD_ASSIGN_OR_RETURN(u.optimizer, UniversalOptimizer::Make(std::move(params), *optimizer_state,
                                                                   ckpt.metadata[0], *ckpt.weights_from_masters));
  } else {
    u.optimizer_status = Status::Unsupported(
        m.files.tag_dir + " has no zero/optimizer_state.pt (BigScience's older universal form), so the "
        "optimizer's hyperparameters are unknown; pass --weights-only to write the fp32 masters as the weights");
  }
  return u;
}

Finding UniversalOptimizerFinding(const SourceOptimizer& opt) {
  return {Finding::Severity::kInfo,
          "optimizer: universal per-parameter files (" + std::to_string(opt.num_groups()) + " groups, states " +
              Join(opt.states(), ", ") + "); converted into " +
              (opt.format().zero ? "ZeRO-1/2" : "BF16 optimizer") + " shards"};
}

}  // namespace reshard
