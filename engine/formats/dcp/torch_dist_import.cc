#include "formats/dcp/torch_dist_import.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <set>

#include "container/torch_file.h"
#include "formats/dcp/torch_dist_optimizer.h"
#include "logical/imported_layers.h"
#include "logical/settings.h"
#include "rules/builtin_rules.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";
// Megatron-Core before 0.19 writes the common state beside the data files;
// 0.19 writes it as a bytes item.
constexpr char kCommonFile[] = "common.pt";
constexpr char kCommonItemPrefix[] = "common_state/";
// Keys of the distributed optimizer's state, and of Transformer Engine's
// per-module state.
constexpr char kExtraState[] = "._extra_state";

std::string WithBlock(std::string name, int64_t block) {
  const size_t at = name.find(kBlock);
  if (at != std::string::npos) name.replace(at, sizeof(kBlock) - 1, std::to_string(block));
  return name;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The common state dict (None when the checkpoint has none). Megatron wraps
// the bytes item's object in a list of one.
Result<Value> CommonState(const DcpContent& c) {
  const std::string file = c.folder + "/" + kCommonFile;
  if (IsFile(file)) {
    PickleReadOptions options;
    options.inert_unknown_classes = true;  // plain data is read out of it; nothing is written back
    return ReadTorchFile(file, options);
  }
  for (const std::string& fqn : c.bytes_items) {
    if (fqn.rfind(kCommonItemPrefix, 0) != 0) continue;
    RESHARD_ASSIGN_OR_RETURN(Value v, c.ReadBytes(fqn));
    if (v.is(Value::Kind::kList) && v.as_list().items.size() == 1) return v.as_list().items[0];
    return v;
  }
  return Value::None();
}

// What the import records of the run: the common state's args and iteration.
Value RunMetadata(const Value& common, const std::string& folder) {
  const Value* args = Find(common, "args");
  const Value* iteration = Find(common, "iteration");
  return Value::MakeDict(
      {{Value::String("args"), args != nullptr && !args->is_none() ? *args : MakeNamespace({})},
       {Value::String("iteration"), iteration != nullptr && iteration->is(Value::Kind::kInt)
                                        ? *iteration
                                        : Value::Int(IterationOfFolder(folder))}});
}

// Reads the checkpoint as the model of one rule set.
class FamilyReader {
 public:
  FamilyReader(const DcpContent& content, const RuleSet& rules, const Value& common, const CommonOptions& options)
      : c_(content), rules_(rules), layout_(*rules.torch_dist()), options_(options), common_(common) {
    ckpt_.metadata.push_back(RunMetadata(common, content.folder));
  }

  Result<TorchDistImport> Read() {
    RESHARD_ASSIGN_OR_RETURN(ckpt_.settings, SettingsValue(options_.set));
    RenameArgs();
    RESHARD_RETURN_IF_ERROR(MapTensors());
    RESHARD_RETURN_IF_ERROR(CheckUnmapped());
    RESHARD_RETURN_IF_ERROR(RecordLayers());
    RESHARD_RETURN_IF_ERROR(Satisfy());
    ReadOptimizer();  // before the args say TP 1, PP 1: a dp_reshardable layout is read with the save's
    SetImportedLayoutArgs(WeightDType(), &ckpt_.metadata[0]);
    RecordSettings();
    // Megatron-LM's --vocab-size, when the args record it, is the true size.
    if (std::optional<int64_t> vocab = MetaRef{{"args.vocab_size"}}.Resolve(inputs())) {
      SetImportedVocabSize(rules_, *vocab, metadata());
    }
    ImportedRuns runs;
    auto keys_of = [this](const std::string& name) { return KeysOf(name); };
    RESHARD_ASSIGN_OR_RETURN(ckpt_.layers, LayOutImported(rules_, blocks_, tensors_, keys_of, c_.folder, &runs));
    RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(options_.rules.empty() ? rules_.name() : options_.rules, options_.set,
                                               &ckpt_));
    AttachImportedRuns(std::move(runs), &ckpt_);
    SetImportedVocab(rules_, VocabRows(), std::nullopt, &ckpt_.metadata[0]);
    return Finish();
  }

 private:
  RuleInputs inputs() const { return RuleInputs{ckpt_.metadata[0], ckpt_.settings}; }
  Value* metadata() { return &ckpt_.metadata[0]; }

  // torch_dist.args: Megatron-Core's names for what the rules read.
  void RenameArgs() {
    for (const TorchDistArg& arg : layout_.args) {
      if (!ArgsMismatch(inputs(), arg.when).empty()) continue;
      const Value* from = arg.value ? arg.value.get() : inputs().Find(arg.from);
      if (from != nullptr) SetPath(metadata(), "args." + arg.set, Value(*from));
    }
  }

  Status MapTensors() {
    for (const TorchDistTensor& entry : layout_.tensors) {
      const DcpTensor* t = FindAny(entry.keys);
      if (t == nullptr) continue;  // LayOutImported refuses it when the rules need it
      used_.insert(t->fqn);
      if (entry.name.find(kBlock) == std::string::npos) {
        RESHARD_RETURN_IF_ERROR(CheckShape(entry, *t, t->size));
        Add(entry.name, *t, -1);
        continue;
      }
      if (t->size.empty()) return Refuse(t->fqn + " has no layer axis to stack " + entry.name + " on");
      if (blocks_ >= 0 && t->size[0] != blocks_) {
        return Refuse(t->fqn + " stacks " + std::to_string(t->size[0]) + " layers, and the keys before it " +
                      std::to_string(blocks_));
      }
      blocks_ = t->size[0];
      RESHARD_RETURN_IF_ERROR(CheckShape(entry, *t, {t->size.begin() + 1, t->size.end()}));
      for (int64_t l = 0; l < blocks_; ++l) Add(WithBlock(entry.name, l), *t, l);
    }
    return Status::Ok();
  }

  const DcpTensor* FindAny(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (const DcpTensor* t = c_.FindTensor(key)) return t;
    }
    return nullptr;
  }

  void Add(const std::string& name, const DcpTensor& t, int64_t layer) {
    mapped_.push_back({name, t.fqn, layer});
    SourceShard runs = SliceRuns(t, layer);
    auto unread = [name](int64_t, int64_t, uint8_t*) {
      return Status::Internal(name + " is read through its runs, not its placeholder tensor");
    };
    tensors_[name] = ImportedTensor{MakeProducedTensor(t.dtype, runs.shape, unread), std::move(runs)};
  }

  // The distributed optimizer's state, each state of each model key sliced
  // into canonical tensors as the key's weights are. A layout that cannot be
  // read leaves the reason for the commands that need the state.
  void ReadOptimizer() {
    auto args = [this](const std::string& path) { return MetaRef{{path}}.Resolve(inputs()); };
    Result<std::optional<TorchDistOptimizer>> read = ReadTorchDistOptimizer(c_, common_, layout_, args);
    if (!read.ok()) {
      optimizer_status_ = read.status().WithContext("torch_dist");
      return;
    }
    if (!*read) return;
    TorchDistOptimizer& states = **read;
    ImportedOptimizer opt;
    opt.moments = {kTorchDistStates[1], kTorchDistStates[2]};
    for (const Mapped& m : mapped_) {
      ImportedOptimizer::Param& p = opt.params[m.name];
      p.master = SliceRuns(states.states[kTorchDistStates[0]].at(m.key), m.layer);
      for (const std::string& moment : opt.moments) p.moments.push_back(SliceRuns(states.states[moment].at(m.key), m.layer));
    }
    // Megatron-Core marks the groups without weight decay by wd_mult 0.
    std::stable_partition(states.param_groups.begin(), states.param_groups.end(), [](const Value& g) {
      const Value* wd_mult = Find(g, "wd_mult");
      return wd_mult == nullptr || !wd_mult->is(Value::Kind::kFloat) || wd_mult->as_float() != 0.0;
    });
    opt.param_groups = std::move(states.param_groups);
    opt.step = std::move(states.step);
    opt.what = "Megatron-Core's distributed optimizer (" + states.layout + ")";
    opt.layout = states.layout;
    notes_.push_back("torch_dist: " + opt.what + ": fp32 masters, exp_avg and exp_avg_sq of " +
                     Count(static_cast<int64_t>(opt.params.size()), "tensor") + ", " +
                     Count(static_cast<int64_t>(opt.param_groups.size()), "param group") +
                     (opt.step ? ", step " + opt.step->DebugString(20) : std::string()));
    optimizer_ = std::move(opt);
  }

  // The entry's shape: a size the args do not record is taken from the
  // tensor (the first entry that meets it), the others must agree.
  Status CheckShape(const TorchDistTensor& entry, const DcpTensor& t, const std::vector<int64_t>& shape) {
    if (entry.shape.empty()) return Status::Ok();
    if (entry.shape.size() != shape.size()) return WrongShape(entry, t, shape);
    for (size_t d = 0; d < shape.size(); ++d) {
      const std::string& dim = entry.shape[d];
      if (dim == "*") continue;
      const size_t star = dim.find('*');
      int64_t factor = 1;
      if (star != std::string::npos) ParseInt(dim.substr(0, star), &factor);
      const std::string path = dim.substr(star == std::string::npos ? 0 : star + 1);
      const std::optional<int64_t> size = MetaRef{{path}}.Resolve(inputs());
      if (size) {
        if (factor * *size != shape[d]) return WrongShape(entry, t, shape);
      } else if (shape[d] % factor != 0) {
        return WrongShape(entry, t, shape);
      } else {
        SetPath(metadata(), path, Value::Int(shape[d] / factor));
      }
    }
    return Status::Ok();
  }

  Status WrongShape(const TorchDistTensor& entry, const DcpTensor& t, const std::vector<int64_t>& shape) const {
    return Refuse(t.fqn + " holds " + ShapeString(shape) + " per layer where the rule set's line " +
                  std::to_string(entry.line) + " has [" + Join(entry.shape, ", ") + "]");
  }

  // Every model key must be the family's; the optimizer's keys are read by
  // ReadOptimizer, Transformer Engine's state is noted.
  Status CheckUnmapped() {
    for (const DcpTensor& t : c_.tensors) {
      if (used_.count(t.fqn)) continue;
      if (IsOptimizerKey(t.fqn)) continue;  // ReadOptimizer's
      return Refuse(t.fqn + " is not a tensor of the model as its torch_dist section maps it");
    }
    for (const std::string& fqn : c_.bytes_items) {
      if (fqn.find(kExtraState) != std::string::npos) extra_states_++;
    }
    return Status::Ok();
  }

  Status RecordLayers() {
    if (blocks_ < 0) return Refuse("the checkpoint holds no block tensor");
    const std::optional<int64_t> layers = MetaRef{{"args.num_layers"}}.Resolve(inputs());
    if (layers && *layers != blocks_) {
      return Status::InvalidInput(c_.folder + "'s args record num_layers " + std::to_string(*layers) +
                                  ", and its tensors stack " + std::to_string(blocks_) + " layers");
    }
    SetPath(metadata(), "args.num_layers", Value::Int(blocks_));
    return Status::Ok();
  }

  // The args the rules read that --set gives, recorded as a run records
  // them, so that the next conversion of what is written knows them.
  void RecordSettings() {
    for (const std::string& path : rules_.ValuePaths()) {
      if (path.rfind("args.", 0) != 0 || WalkPath(ckpt_.metadata[0], path) != nullptr) continue;
      if (const Value* given = WalkPath(ckpt_.settings, path)) SetPath(metadata(), path, *given);
    }
  }

  // The family's conditions (detect.args, and what its HF export requires)
  // set where nothing records them; refused where the args say otherwise.
  Status Satisfy() {
    std::vector<std::string> assumed;
    for (const ArgConditions* conditions : {&rules_.detect().args, HfRequirements()}) {
      for (const auto& [field, expected] : *conditions) {
        if (inputs().Find("args." + field) != nullptr) continue;
        std::optional<Value> v = ValueThatHolds(expected);
        if (!v) continue;
        SetPath(metadata(), "args." + field, *v);
        // "!x" (anything but x) asks for nothing in particular.
        if (!v->is_none() && expected.rfind('!', 0) != 0) assumed.push_back(field + "=" + v->DebugString(20));
      }
    }
    if (!assumed.empty()) {
      notes_.push_back("torch_dist: the checkpoint's args do not record " + Join(assumed, ", ") +
                       "; read as rule set " + rules_.name() + "'s model has them");
    }
    const std::string mismatch = ArgsMismatch(inputs(), rules_.detect().args);
    if (!mismatch.empty()) return Refuse("its args describe another model: " + mismatch);
    return Status::Ok();
  }

  const ArgConditions* HfRequirements() const {
    static const ArgConditions none;
    return rules_.hf() ? &rules_.hf()->requirements : &none;
  }

  std::string KeysOf(const std::string& name) const {
    for (const TorchDistTensor& entry : layout_.tensors) {
      for (int64_t l = 0; l < std::max<int64_t>(blocks_, 1); ++l) {
        if (WithBlock(entry.name, l) == name) return Join(entry.keys, " or ");
      }
    }
    return "";
  }

  // The training dtype: a bf16 or fp16 run keeps its norms in fp32.
  DType WeightDType() const {
    for (const auto& [name, t] : tensors_) {
      const DType dtype = t.tensor.as_tensor().storage->dtype;
      if (IsFloatingPoint(dtype) && dtype != DType::kFloat32) return dtype;
    }
    return DType::kFloat32;
  }

  int64_t VocabRows() const {
    for (const LogicalLayer& layer : ckpt_.layers) {
      for (const LogicalTensor& t : layer.tensors) {
        if (t.rule->policy == ParamRule::Policy::kVocab) return t.full_shape[0];
      }
    }
    return 0;
  }

  Result<TorchDistImport> Finish() {
    if (!optimizer_status_.ok()) {
      notes_.push_back(optimizer_status_.message());  // "torch_dist: <why it is not read>; <fix>"
    }
    if (extra_states_ > 0) {
      notes_.push_back("torch_dist: Transformer Engine's _extra_state (" + Count(extra_states_, "item") +
                       ") is dropped: Megatron-DeepSpeed's layer files have no place for it");
    }
    TorchDistImport out;
    out.logical = std::move(ckpt_);
    out.files = c_.Paths();
    const int64_t iteration = MetadataInt(out.logical.metadata[0], "iteration", 0);
    out.logical.iteration = iteration;  // what verify compares with a checkpoint converted from it
    out.what = "Megatron-Core torch_dist checkpoint" +
               (iteration > 0 ? "; iteration " + std::to_string(iteration) : std::string()) + " (" +
               Count(static_cast<int64_t>(c_.files.size()), ".distcp file") + ")";
    out.notes = std::move(notes_);
    out.optimizer = std::move(optimizer_);
    out.optimizer_status = optimizer_status_;
    return out;
  }

  Status Refuse(const std::string& why) const { return Status::Unsupported(rules_.name() + ": " + why); }

  const DcpContent& c_;
  const RuleSet& rules_;
  const TorchDistLayout& layout_;
  const CommonOptions& options_;
  const Value& common_;
  LogicalCheckpoint ckpt_;
  // Which key (and layer of it) each canonical tensor is read from.
  struct Mapped {
    std::string name, key;
    int64_t layer = -1;
  };
  std::vector<Mapped> mapped_;
  std::optional<ImportedOptimizer> optimizer_;
  Status optimizer_status_;
  std::map<std::string, ImportedTensor> tensors_;
  std::set<std::string> used_;
  int64_t blocks_ = -1;
  int64_t extra_states_ = 0;
  std::vector<std::string> notes_;
};

Result<std::vector<RuleSet>> Candidates(const std::string& spec) {
  std::vector<RuleSet> out;
  if (!spec.empty()) {
    RESHARD_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(spec));
    if (rules.torch_dist() == nullptr) {
      return Status::RuleError("rule set " + rules.name() + " has no torch_dist section, so it cannot read a "
                               "Megatron-Core torch_dist checkpoint; add one (docs/rules.md) or choose another set");
    }
    out.push_back(std::move(rules));
    return out;
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  for (RuleSet& rules : all) {
    if (rules.torch_dist() != nullptr) out.push_back(std::move(rules));
  }
  return out;
}

}  // namespace

Result<TorchDistImport> ReadTorchDistImport(const DcpContent& content, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(Value common, CommonState(content));
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> candidates, Candidates(options.rules));
  std::vector<std::string> reasons;
  for (const RuleSet& rules : candidates) {
    Result<TorchDistImport> imported = FamilyReader(content, rules, common, options).Read();
    if (imported.ok() || !options.rules.empty()) return imported;
    reasons.push_back(imported.status().message());
  }
  return Status::Unsupported("no built-in rule set reads this torch_dist checkpoint (" + Join(reasons, "; ") +
                             "); write a rule file with a torch_dist section (docs/rules.md) and pass --rules FILE");
}

}  // namespace reshard
