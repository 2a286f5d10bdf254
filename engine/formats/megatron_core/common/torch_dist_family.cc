#include "formats/megatron_core/common/torch_dist_family.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "container/regular_file.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "logical/settings.h"
#include "rules/builtin_rules.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";
constexpr char kExpert[] = "{expert}";

}  // namespace

std::string WithBlock(std::string name, int64_t block) {
  const size_t at = name.find(kBlock);
  if (at != std::string::npos) name.replace(at, sizeof(kBlock) - 1, std::to_string(block));
  return name;
}

std::string WithExpert(std::string name, int64_t expert) {
  const size_t at = name.find(kExpert);
  if (at != std::string::npos) name.replace(at, sizeof(kExpert) - 1, std::to_string(expert));
  return name;
}

bool StacksExperts(const TorchDistTensor& entry) { return entry.name.find(kExpert) != std::string::npos; }

Value ImportedRunMetadata(const Value& state, int64_t fallback) {
  const Value* args = Find(state, "args");
  const Value* iteration = Find(state, "iteration");
  Value run = Value::MakeDict(
      {{Value::String("args"), args != nullptr && !args->is_none() ? *args : MakeNamespace({})},
       {Value::String("iteration"),
        iteration != nullptr && iteration->is(Value::Kind::kInt) ? *iteration : Value::Int(fallback)}});
  for (const char* key : {"opt_param_scheduler", "lr_scheduler"}) {
    const Value* scheduler = Find(state, key);
    if (scheduler != nullptr && DictItems(*scheduler) != nullptr) {
      Set(run, "lr_scheduler", *scheduler);
      break;
    }
  }
  return run;
}

Status CheckRunState(const Value& state, const std::string& where) {
  if (DictItems(state) == nullptr || state.is(Value::Kind::kObject)) {
    return Status::InvalidInput(where + " holds " + state.DebugString(80) + ", not the dict Megatron saves");
  }
  const Value* args = Find(state, "args");
  const bool namespace_args = args == nullptr || args->is_none() ||
                              (args->is(Value::Kind::kObject) && args->as_object().cls.Qualified() == "argparse.Namespace");
  if (!namespace_args) return Status::InvalidInput(where + " holds args " + args->DebugString(80) + ", not an argparse.Namespace");
  const Value* iteration = Find(state, "iteration");
  if (iteration != nullptr && !iteration->is(Value::Kind::kInt)) {
    return Status::InvalidInput(where + " holds the iteration " + iteration->DebugString(60) + ", not an int");
  }
  return Status::Ok();
}

Result<std::vector<RuleSet>> TorchDistCandidates(const std::string& spec, const std::string& what) {
  return RuleSetsWithSection(spec, "torch_dist", [](const RuleSet& r) { return r.section<TorchDistLayout>() != nullptr; }, what);
}

TorchDistFamily::TorchDistFamily(const RuleSet& rules, Value run, const CommonOptions& options, std::string label)
    : rules_(rules), layout_(*rules.section<TorchDistLayout>()), options_(options), label_(std::move(label)) {
  ckpt_.metadata.push_back(std::move(run));
}

Status TorchDistFamily::Start() {
  RESHARD_ASSIGN_OR_RETURN(ckpt_.settings, SettingsValue(options_.set));
  RenameArgs();
  return Status::Ok();
}

// torch_dist.args: Megatron-Core's names for what the rules read.
void TorchDistFamily::RenameArgs() {
  for (const TorchDistArg& arg : layout_.args) {
    if (!ArgsMismatch(inputs(), arg.when).empty()) continue;
    const Value* from = arg.value ? arg.value.get() : inputs().Find(arg.from);
    if (from != nullptr) SetPath(metadata(), "args." + arg.set, Value(*from));
  }
}

Status TorchDistFamily::CheckShape(const TorchDistTensor& entry, const std::string& key,
                                   const std::vector<int64_t>& shape) {
  if (entry.shape.empty()) return Status::Ok();
  auto wrong = [&] {
    return Refuse(key + " holds " + ShapeString(shape) + (entry.name.find(kBlock) != std::string::npos ? " per layer" : "") +
                  " where the rule set's line " + std::to_string(entry.line) + " has [" + Join(entry.shape, ", ") + "]");
  };
  if (entry.shape.size() != shape.size()) return wrong();
  for (size_t d = 0; d < shape.size(); ++d) {
    const std::string& dim = entry.shape[d];
    if (dim == "*") continue;
    const size_t star = dim.find('*');
    int64_t factor = 1;
    if (star != std::string::npos) ParseInt(dim.substr(0, star), &factor);
    const std::string path = dim.substr(star == std::string::npos ? 0 : star + 1);
    const std::optional<int64_t> size = MetaRef{{path}}.Resolve(inputs());
    if (size) {
      if (factor * *size != shape[d]) return wrong();
    } else if (shape[d] % factor != 0) {
      return wrong();
    } else {
      SetPath(metadata(), path, Value::Int(shape[d] / factor));
    }
  }
  return Status::Ok();
}

Status TorchDistFamily::RecordBlocks(int64_t blocks, const std::string& folder) {
  if (blocks <= 0) return Refuse("the checkpoint holds no block tensor");
  const std::optional<int64_t> layers = MetaRef{{"args.num_layers"}}.Resolve(inputs());
  if (layers && *layers != blocks) {
    return Status::InvalidInput(folder + "'s args record num_layers " + std::to_string(*layers) +
                                ", and its tensors hold " + std::to_string(blocks) + " layers");
  }
  SetPath(metadata(), "args.num_layers", Value::Int(blocks));
  blocks_ = blocks;
  return Status::Ok();
}

Status TorchDistFamily::RecordExperts(int64_t experts, const std::string& folder) {
  if (std::none_of(layout_.tensors.begin(), layout_.tensors.end(), StacksExperts)) return Status::Ok();
  // Megatron-Core stacks the experts of all layers on one key only when
  // every layer is a MoE layer; a mixed model's keys are per layer.
  if (const Value* freq = inputs().Find("args.moe_layer_freq")) {
    auto moe = [](const Value& v) { return v.is(Value::Kind::kInt) && v.as_int() == 1; };
    bool every = freq->is_none() || moe(*freq);
    if (freq->is(Value::Kind::kList)) {
      const std::vector<Value>& layers = freq->as_list().items;
      every = std::all_of(layers.begin(), layers.end(), moe);
    }
    if (!every) {
      return Refuse("its args record moe_layer_freq " + freq->DebugString(40) + ": a model mixing dense and MoE "
                    "layers is not read yet (only MoE in every layer, moe_layer_freq 1)");
    }
  }
  if (experts == 0) return Status::Ok();  // the keys the family needs are missing: refused by name later
  const std::optional<int64_t> recorded = MetaRef{{"args.num_moe_experts"}}.Resolve(inputs());
  if (recorded && *recorded != experts) {
    return Status::InvalidInput(folder + "'s args record num_moe_experts " + std::to_string(*recorded) +
                                ", and its tensors hold " + std::to_string(experts) + " experts per layer");
  }
  SetPath(metadata(), "args.num_moe_experts", Value::Int(experts));
  experts_ = experts;
  return Status::Ok();
}

Status TorchDistFamily::Satisfy() {
  static const ArgConditions none;
  std::vector<std::string> assumed;
  for (const ArgConditions* conditions : {&rules_.detect().args, rules_.section<HfExport>() ? &rules_.section<HfExport>()->requirements : &none}) {
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
    notes_.push_back(label_ + ": the checkpoint's args do not record " + Join(assumed, ", ") + "; read as rule set " +
                     rules_.name() + "'s model has them");
  }
  const std::string mismatch = ArgsMismatch(inputs(), rules_.detect().args);
  if (!mismatch.empty()) return Refuse("its args describe another model: " + mismatch);
  return Status::Ok();
}

// The args the rules read that --set gives, recorded as a run records
// them, so that the next conversion of what is written knows them.
void TorchDistFamily::RecordSettings() {
  for (const std::string& path : rules_.ValuePaths()) {
    if (path.rfind("args.", 0) != 0 || WalkPath(ckpt_.metadata[0], path) != nullptr) continue;
    if (const Value* given = WalkPath(ckpt_.settings, path)) SetPath(metadata(), path, *given);
  }
}

// The training dtype: a bf16 or fp16 run keeps its norms in fp32.
DType TorchDistFamily::WeightDType(const std::map<std::string, ImportedTensor>& tensors) const {
  for (const auto& [name, t] : tensors) {
    const DType dtype = t.tensor.as_tensor().storage->dtype;
    if (IsFloatingPoint(dtype) && dtype != DType::kFloat32) return dtype;
  }
  return DType::kFloat32;
}

Result<LogicalCheckpoint> TorchDistFamily::Finish(const std::map<std::string, ImportedTensor>& tensors,
                                                  const std::function<std::string(const std::string&)>& source_of,
                                                  const std::string& folder) {
  SetImportedLayoutArgs(WeightDType(tensors), metadata());
  RecordSettings();
  // Megatron-LM's --vocab-size, when the args record it, is the true size.
  if (std::optional<int64_t> vocab = MetaRef{{"args.vocab_size"}}.Resolve(inputs())) {
    SetImportedVocabSize(rules_, *vocab, metadata());
  }
  ImportedRuns runs;
  RESHARD_ASSIGN_OR_RETURN(ckpt_.layers, LayOutImported(rules_, blocks_, experts_, tensors, source_of, folder, &runs));
  RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(options_.rules.empty() ? rules_.name() : options_.rules, options_.set,
                                             &ckpt_));
  AttachImportedRuns(std::move(runs), &ckpt_);
  int64_t vocab_rows = 0;
  for (const LogicalLayer& layer : ckpt_.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->policy == ParamRule::Policy::kVocab) vocab_rows = t.full_shape[0];
    }
  }
  SetImportedVocab(rules_, vocab_rows, std::nullopt, metadata());
  ckpt_.iteration = MetadataInt(ckpt_.metadata[0], "iteration", 0);  // what verify compares with a conversion of it
  return std::move(ckpt_);
}

Result<const ParamRule*> TorchDistFamily::RuleOf(const std::string& name, int64_t blocks) const {
  return ImportedRuleOf(rules_, blocks, experts_, name, "rule set " + rules_.name() + "'s torch_dist section");
}

const TorchDistTensor* TorchDistFamily::EntryOf(const std::string& key) const {
  for (const TorchDistTensor& entry : layout_.tensors) {
    for (const std::string& k : entry.keys) {
      if (k == key) return &entry;
    }
  }
  return nullptr;
}

std::string TorchDistFamily::KeysOf(const std::string& name) const {
  for (const TorchDistTensor& entry : layout_.tensors) {
    for (int64_t l = 0; l < std::max<int64_t>(blocks_, 1); ++l) {
      for (int64_t e = 0; e < std::max<int64_t>(experts_, 1); ++e) {
        if (WithExpert(WithBlock(entry.name, l), e) == name) return Join(entry.keys, " or ");
      }
    }
  }
  return "";
}

Status TorchDistFamily::Refuse(const std::string& why) const { return Status::Unsupported(rules_.name() + ": " + why); }

}  // namespace reshard
