#include "formats/hf_common/hf_import.h"

#include <re2/re2.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "formats/hf_common/hf_folder.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "logical/imported_layers.h"
#include "logical/rule_selection.h"
#include "logical/settings.h"
#include "rules/builtin_rules.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Megatron's --make-vocab-size-divisible-by default.
constexpr int64_t kMegatronVocabMultiple = 128;

// ---- the family ------------------------------------------------------------

std::vector<std::string> Architectures(const Value& config) {
  std::vector<std::string> names;
  const Value* list = Find(config, "architectures");
  if (list != nullptr && list->is(Value::Kind::kList)) {
    for (const Value& v : list->as_list().items) {
      if (v.is(Value::Kind::kString)) names.push_back(v.as_string());
    }
  }
  return names;
}

bool Computes(const RuleSet& rules, const std::vector<std::string>& architectures) {
  return rules.section<HfExport>() != nullptr && std::find(architectures.begin(), architectures.end(),
                                            rules.section<HfExport>()->architecture) != architectures.end();
}

// ---- config.json -> args ----------------------------------------------------

// Numbers compare by value (1 == 1.0); everything else by kind and content.
bool SameValue(const Value& a, const Value& b) {
  auto number = [](const Value& v, double* d) {
    if (v.is(Value::Kind::kInt)) *d = static_cast<double>(v.as_int());
    else if (v.is(Value::Kind::kFloat)) *d = v.as_float();
    else return false;
    return true;
  };
  double x = 0, y = 0;
  if (number(a, &x) && number(b, &y)) return x == y;
  return a.kind() == b.kind() && a.DebugString() == b.DebugString();
}

// How well the config agrees with the fixed values of `rules`' hf.config
// (tie_word_embeddings, attention_bias, ...): one for each value the config
// states alike, far below zero for each it states otherwise.
int Agreement(const RuleSet& rules, const Value& config) {
  int score = 0;
  for (const HfConfigField& field : rules.section<HfExport>()->config) {
    const Value* v = Find(config, field.key);
    if (v == nullptr || !field.literal || !field.paths.empty() || !field.cases.empty()) continue;
    score += SameValue(*v, *field.literal) ? 1 : -1000;
  }
  return score;
}

// The rule sets whose hf section is the folder's architecture, best first:
// `spec` (a --rules name or file), else the built-in sets that export it,
// those whose fixed values the config states best first (Llama untied and
// tied are two sets of one architecture).
Result<std::vector<RuleSet>> Families(const Value& config, const std::string& config_path, const std::string& spec) {
  const std::vector<std::string> architectures = Architectures(config);
  const std::string named = architectures.empty() ? "no architecture" : Join(architectures, ", ");
  if (!spec.empty()) {
    RESHARD_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(spec));
    if (Computes(rules, architectures)) {
      std::vector<RuleSet> chosen;
      chosen.push_back(std::move(rules));
      return chosen;
    }
    return Status::Unsupported(config_path + " names " + named + ", and rule set " + rules.name() + " maps " +
                               (rules.section<HfExport>() ? rules.section<HfExport>()->architecture : "no HF architecture (no hf section)") +
                               "; choose the rule set whose hf section is the folder's architecture");
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  std::vector<RuleSet> families;
  std::vector<std::string> known;
  for (RuleSet& rules : all) {
    if (rules.section<HfExport>() != nullptr) known.push_back(rules.section<HfExport>()->architecture + " (" + rules.name() + ")");
    if (Computes(rules, architectures)) families.push_back(std::move(rules));
  }
  if (families.empty()) {
    return Status::Unsupported(config_path + " names " + named + ", which no built-in rule set maps (they map " +
                               Join(known, ", ") + "); add an hf section to a rule file (docs/rules.md) and pass "
                               "--rules FILE");
  }
  std::stable_sort(families.begin(), families.end(), [&config](const RuleSet& a, const RuleSet& b) {
    return Agreement(a, config) > Agreement(b, config);
  });
  return families;
}


// What the import builds the metadata from, and where it tells of problems.
struct ConfigReader {
  const Value& config;
  const std::string& config_path;
  const std::string fix;  // how a missing field is given: "add it to config.json or give"
  const RuleSet& rules;
  const Value& settings;
  Value* metadata;
  std::vector<std::string>* notes;

  RuleInputs inputs() const { return RuleInputs{*metadata, settings}; }
  const Value* Get(const std::string& key) const {
    const Value* v = Find(config, key);
    return v != nullptr && !v->is_none() ? v : nullptr;
  }
  std::string Where(const HfConfigField& f) const {
    return "(hf.config line " + std::to_string(f.line) + " of " + rules.origin() + ")";
  }

  // Sets what `conditions` name where nothing holds them yet.
  void Satisfy(const ArgConditions& conditions) {
    for (const auto& [field, expected] : conditions) {
      if (ArgHolds(inputs(), field, expected) || inputs().Find("args." + field) != nullptr) continue;
      if (std::optional<Value> v = ValueThatHolds(expected)) SetPath(metadata, "args." + field, *v);
    }
  }

  Status Field(const HfConfigField& f) {
    const Value* v = Get(f.key);
    if (!f.cases.empty()) return FromCases(f, v);
    if (!f.paths.empty()) return FromPath(f, v);
    if (v == nullptr || SameValue(*v, *f.literal)) return Status::Ok();  // absent: transformers' default
    return Status::Unsupported(config_path + " has " + f.key + " = " + v->DebugString(60) + ", and " +
                               rules.section<HfExport>()->architecture + " as rule set " + rules.name() + " maps it computes "
                               "the model only with " + f.literal->DebugString(60) + " " + Where(f) +
                               (f.why_not.empty() ? "" : "; " + f.why_not));
  }

  Status FromCases(const HfConfigField& f, const Value* v) {
    std::vector<std::string> values;
    const HfConfigField::Case* closest = nullptr;  // the first mapping case a mapping misses
    std::string miss;
    for (const HfConfigField::Case& c : f.cases) {
      const std::string why = CaseMiss(f, c, v);
      if (why.empty()) {
        for (const HfConfigField& entry : c.entries) {
          if (!entry.paths.empty()) SetPath(metadata, entry.paths.front(), *Find(*v, entry.key));
        }
        Satisfy(c.when);
        return Status::Ok();
      }
      values.push_back(c.entries.empty() ? c.value->DebugString(40) : "a mapping");
      if (closest == nullptr && !c.entries.empty() && v != nullptr && DictItems(*v) != nullptr) {
        closest = &c;
        miss = why;
      }
    }
    if (closest != nullptr) {
      return Status::Unsupported(config_path + " has " + miss + " " + Where(f) +
                                 (closest->why_not.empty() ? "" : "; " + closest->why_not));
    }
    return Status::Unsupported(config_path + (v ? " has " + f.key + " = " + v->DebugString(60) : " has no " + f.key) +
                               "; rule set " + rules.name() + " trains the model only with " + Join(values, ", ") +
                               " " + Where(f));
  }

  // How config.json's value `v` (null when absent or null) misses case `c`:
  // "" when it is the case's value; else, for a mapping case, the first entry
  // that differs, is missing or has no place ("rope_scaling.low_freq_factor =
  // 2.0, and ... only with 1.0").
  std::string CaseMiss(const HfConfigField& f, const HfConfigField::Case& c, const Value* v) const {
    if (c.entries.empty()) {
      const bool same = v == nullptr ? c.value->is_none() : SameValue(*v, *c.value);
      return same ? "" : "another value";
    }
    const Items* items = v != nullptr ? DictItems(*v) : nullptr;
    if (items == nullptr) return "not a mapping";
    const std::string only = ", and rule set " + rules.name() + " computes the model only with ";
    for (const HfConfigField& entry : c.entries) {
      const std::string name = f.key + "." + entry.key;
      const Value* given = Find(*v, entry.key);
      const std::string wanted = entry.paths.empty() ? entry.literal->DebugString(40) : "a value (" + entry.paths.front() + ")";
      if (given == nullptr) return "no " + name + only + wanted + " there";
      if (entry.paths.empty() && !SameValue(*given, *entry.literal)) {
        return name + " = " + given->DebugString(40) + only + wanted;
      }
    }
    for (const auto& [key, value] : *items) {
      const std::string name = key.is(Value::Kind::kString) ? key.as_string() : key.DebugString(40);
      if (std::none_of(c.entries.begin(), c.entries.end(), [&](const HfConfigField& e) { return e.key == name; })) {
        return f.key + "." + name + " = " + value.DebugString(40) + ", which rule set " + rules.name() +
               " has no place for";
      }
    }
    return "";
  }

  Status FromPath(const HfConfigField& f, const Value* v) {
    const std::string& path = f.paths.front();
    if (v != nullptr) {
      SetPath(metadata, path, *v);
      return Status::Ok();
    }
    if (!f.null_means.empty() && inputs().Find(path) == nullptr) return FromNull(f);
    // A fallback (another path or a literal) stands for transformers' default.
    if (f.paths.size() > 1 || f.literal || inputs().Find(path) != nullptr) return Status::Ok();
    return Status::InvalidInput(config_path + " has no " + f.key + ", which rule set " + rules.name() +
                                " reads as " + path + " " + Where(f) + "; " + fix + " --set " +
                                (path.rfind("args.", 0) == 0 ? path.substr(5) : path) + "=VALUE");
  }

  // config.json's null (or no key) for a field whose null stands for a size
  // (GPT-2's n_inner: 4 x n_embd): that size, recorded as the run records it.
  Status FromNull(const HfConfigField& f) {
    Result<int64_t> size = HfSize(f.null_means, inputs());
    if (!size.ok()) {
      return Status::InvalidInput(config_path + "'s " + f.key + " is null, which " + rules.section<HfExport>()->architecture +
                                  " reads as " + f.null_means + " " + Where(f) + ", and " + size.status().message());
    }
    SetPath(metadata, f.paths.front(), Value::Int(*size));
    notes->push_back("hf: " + f.key + " is null, which " + rules.section<HfExport>()->architecture + " reads as " + f.null_means +
                     " = " + std::to_string(*size) + "; recorded as " + f.paths.front());
    return Status::Ok();
  }

  Status Check(const ArgConditions& conditions, const std::string& what) const {
    const std::string mismatch = ArgsMismatch(inputs(), conditions);
    if (mismatch.empty()) return Status::Ok();
    return Status::Unsupported(config_path + " describes a model " + what + " does not compute: " + mismatch +
                               " (as read from the config and --set)");
  }
};

// What the import records of the run, in no format's layout: the Megatron
// args it derives (the rules read them as args.*) and the iteration of a run
// that has not trained. The keys the rules detect and read are added beside
// them; a format that writes the model adds its own files' fields.
Value UntrainedRunMetadata() {
  return Value::MakeDict({{Value::String("args"), MakeNamespace({})}, {Value::String("iteration"), Value::Int(0)}});
}

// A run that has not trained: its counters at 0.
void SetUntrainedCounters(Value* metadata) {
  for (const char* key : {"iteration", "consumed_train_samples", "consumed_valid_samples"}) {
    SetPath(metadata, std::string("args.") + key, Value::Int(0));
  }
}

// ---- HF tensors -> canonical tensors ------------------------------------------

// A canonical tensor made of HF tensors: the bytes themselves when it is
// one HF tensor as is; else the runs it is made of.
using Joined = ImportedTensor;

// `t` transposed into a buffer of its own: GPT-2's Conv1D [in, out] back to
// [out, in], by the export's own transpose.
Value TransposedCopy(const Tensor& t) {
  const int element = ElementSize(t.storage->dtype);
  const int64_t rows = t.sizes[0], cols = t.sizes[1];
  auto bytes = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(rows * cols * element));
  TransposeMatrix(TensorData(t), rows, cols, element, bytes->data());
  return MakeOwnedTensor(t.storage->dtype, {cols, rows}, std::move(bytes));
}

class TensorJoiner {
 public:
  TensorJoiner(const HfFolder& folder, const RuleSet& rules, const RuleInputs& inputs)
      : folder_(folder), hf_(*rules.section<HfExport>()), rules_(rules), inputs_(inputs) {}

  // Every canonical tensor the folder's tensors make, by name.
  Result<std::map<std::string, Joined>> JoinAll() {
    std::map<std::string, Joined> out;
    for (const HfTensorMap& map : hf_.tensors) {
      for (const auto& [block, expert] : Slots(map)) {
        const std::string name = HfNameTemplate(map.from).With(block, expert);
        if (!block.empty()) blocks_.insert(block);
        if (!expert.empty()) experts_.insert(expert);
        RESHARD_ASSIGN_OR_RETURN(Joined joined, JoinOne(map, name, block, expert));
        out.emplace(name, std::move(joined));
      }
    }
    for (const auto& [name, tensor] : folder_.tensors) {
      if (used_.count(name)) continue;
      return Status::Unsupported(folder_.Named(name) + " is not a tensor of " + hf_.architecture +
                                 " as rule set " + rules_.name() + " maps it (its hf.tensors); the folder holds "
                                 "another model, or the rule file's hf section lacks an entry");
    }
    return out;
  }

  int64_t transposed_bytes() const { return transposed_bytes_; }
  // How many blocks, and experts per layer, the folder holds tensors of (once JoinAll has run).
  int64_t block_count() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t expert_count() const { return static_cast<int64_t>(experts_.size()); }

 private:
  // The (block, expert) pairs ("" outside blocks, experts) the folder has the
  // entry's first HF tensor for, in numeric order.
  std::vector<std::pair<std::string, std::string>> Slots(const HfTensorMap& map) const {
    const HfNameTemplate first(map.to.front());
    std::vector<std::pair<std::pair<int64_t, int64_t>, std::pair<std::string, std::string>>> slots;
    for (const auto& [name, tensor] : folder_.tensors) {
      std::string block, expert;
      if (!first.Match(name, &block, &expert)) continue;
      int64_t b = -1, e = -1;
      ParseInt(block, &b);
      ParseInt(expert, &e);
      slots.push_back({{b, e}, {block, expert}});
    }
    std::sort(slots.begin(), slots.end());
    std::vector<std::pair<std::string, std::string>> out;
    for (auto& [order, slot] : slots) out.push_back(std::move(slot));
    return out;
  }

  // The entry's HF tensors of `block` and `expert`, transposed back where it says so.
  Result<std::vector<Joined>> Parts(const HfTensorMap& map, const std::string& block, const std::string& expert) {
    std::vector<Joined> parts;
    for (const std::string& to : map.to) {
      const std::string name = HfNameTemplate(to).With(block, expert);
      auto it = folder_.tensors.find(name);
      if (it == folder_.tensors.end()) {
        return Status::InvalidInput(folder_.Label() + " has " + HfNameTemplate(map.to.front()).With(block, expert) +
                                    " but not " + name + ", which " + hf_.architecture + " needs with it");
      }
      used_.insert(name);
      const Tensor& t = it->second.as_tensor();
      auto runs = folder_.runs.find(name);
      std::optional<SourceShard> shard;
      if (runs != folder_.runs.end()) shard = runs->second;
      if (map.transpose && (t.sizes.size() != 2 || shard)) {
        return Status::InvalidInput(folder_.Named(name) + " has shape " + ShapeString(t.sizes) + ", not the "
                                    "matrix " + hf_.architecture + " stores transposed, whole in one file");
      }
      if (map.transpose) transposed_bytes_ += t.numel() * ElementSize(t.storage->dtype);
      parts.push_back({map.transpose ? TransposedCopy(t) : it->second, std::move(shard)});
    }
    return parts;
  }

  Result<Joined> JoinOne(const HfTensorMap& map, const std::string& name, const std::string& block,
                         const std::string& expert) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Joined> parts, Parts(map, block, expert));
    const Tensor& first = parts.front().tensor.as_tensor();
    std::vector<int64_t> shape = first.sizes;
    if (shape.empty()) shape = {1};
    shape[0] = 0;
    for (const Joined& part : parts) {
      const Tensor& t = part.tensor.as_tensor();
      std::vector<int64_t> rest = t.sizes.empty() ? std::vector<int64_t>{1} : t.sizes;
      shape[0] += rest[0];
      rest[0] = shape[0];
      if (rest != shape || t.storage->dtype != first.storage->dtype) {
        return Status::InvalidInput("the HF tensors of " + name + " (" + Join(map.to, ", ") + ") differ in dtype "
                                    "or in their dims after the first");
      }
    }
    if (first.sizes.empty()) shape = {};
    RESHARD_RETURN_IF_ERROR(CheckHfShape(hf_, map, name, shape, inputs_));
    Result<std::vector<HfPart>> parted = HfParts(map, name, shape, inputs_, block, expert);
    if (!parted.ok()) return Status::InvalidInput("config.json disagrees with the tensors: " + parted.status().message());
    const std::vector<HfPart>& want = *parted;
    for (size_t j = 0; j < parts.size(); ++j) {
      const Tensor& t = parts[j].tensor.as_tensor();
      const int64_t rows = t.sizes.empty() ? 1 : t.sizes[0];
      if (rows != want[j].rows) {
        return Status::InvalidInput("config.json disagrees with the tensors: " + want[j].name + " has " +
                                    std::to_string(rows) + " rows, and the config's sizes give it " +
                                    std::to_string(want[j].rows) + " of the " + std::to_string(shape[0]) + " of " + name);
      }
    }
    if (parts.size() == 1 && want[0].runs.empty() && !map.transpose) return parts[0];
    // The placeholder only gives the shape and dtype: readers use the shard.
    auto unread = [name](int64_t, int64_t, uint8_t*) {
      return Status::Internal(name + " is read through its shard, not its placeholder tensor");
    };
    return Joined{MakeProducedTensor(first.storage->dtype, shape, unread), Runs(parts, want, shape)};
  }

  // The canonical tensor's elements in order, as runs of the parts' bytes:
  // part j's rows fill, one after another, the canonical rows want[j] names.
  static SourceShard Runs(const std::vector<Joined>& parts, const std::vector<HfPart>& want,
                          const std::vector<int64_t>& shape) {
    struct Piece {
      int64_t first, count;  // canonical rows
      size_t part;
      int64_t part_row;
    };
    std::vector<Piece> pieces;
    for (size_t j = 0; j < want.size(); ++j) {
      const std::vector<RowRun> runs = want[j].runs.empty() ? std::vector<RowRun>{{0, want[j].rows}} : want[j].runs;
      int64_t at = 0;
      for (const RowRun& run : runs) {
        pieces.push_back({run.first, run.count, j, at});
        at += run.count;
      }
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.first < b.first; });
    const int64_t row_elements = shape.empty() || shape[0] == 0 ? 1 : ShapeNumel(shape) / shape[0];
    SourceShard shard;
    for (const Piece& p : pieces) {
      const Joined& part = parts[p.part];
      const Tensor& t = part.tensor.as_tensor();
      const size_t element = static_cast<size_t>(ElementSize(t.storage->dtype));
      if (part.runs) {
        for (SourceShard::Run run : part.runs->RunsOf(p.part_row * row_elements, p.count * row_elements, element)) {
          run.begin += p.first * row_elements;
          shard.runs.push_back(std::move(run));
        }
        continue;
      }
      const ByteView& file = t.storage->bytes;
      const uint8_t* data = TensorData(t) + p.part_row * row_elements * element;
      shard.runs.push_back({p.first * row_elements, p.count * row_elements,
                            ByteView{file.owner, data, static_cast<size_t>(p.count * row_elements) * element, file.mapped}});
    }
    return shard;
  }

  const HfFolder& folder_;
  const HfExport& hf_;
  const RuleSet& rules_;
  const RuleInputs inputs_;  // references the metadata and settings, which outlive the joiner
  std::set<std::string> used_;
  std::set<std::string> blocks_;
  std::set<std::string> experts_;
  int64_t transposed_bytes_ = 0;
};

// The elements of the folder's tensor `name`, as runs.
SourceShard ShardOf(const HfFolder& folder, const std::string& name) {
  auto runs = folder.runs.find(name);
  return runs != folder.runs.end() ? runs->second : SourceShard::Of(folder.tensors.at(name).as_tensor(), {});
}

bool SameElements(const SourceShard& a, const SourceShard& b, int64_t numel, int element) {
  constexpr int64_t kPiece = int64_t{1} << 18;
  std::vector<uint8_t> x(static_cast<size_t>(std::min(numel, kPiece) * element)), y(x.size());
  for (int64_t at = 0; at < numel; at += kPiece) {
    const int64_t n = std::min(kPiece, numel - at);
    a.Copy(at, n, element, x.data(), nullptr);
    b.Copy(at, n, element, y.data(), nullptr);
    if (!std::equal(x.begin(), x.begin() + n * element, y.begin())) return false;
  }
  return true;
}

// The folder's tensors as the architecture names them: "<prefix>." added
// where the folder was saved from the base model (as transformers loads
// it), and set aside the buffers it recomputes and tied copies, which must
// equal what they are tied to. `notes` learns what was set aside.
Status NameAsArchitecture(const HfExport& hf, HfFolder* folder, std::vector<std::string>* notes) {
  const std::string prefix = hf.base_model_prefix + ".";
  const bool base_model = !hf.base_model_prefix.empty() &&
                          std::none_of(folder->tensors.begin(), folder->tensors.end(),
                                       [&](const auto& t) { return t.first.rfind(prefix, 0) == 0; });
  if (base_model) {
    std::map<std::string, Value> renamed;
    for (auto& [name, tensor] : folder->tensors) renamed.emplace(prefix + name, std::move(tensor));
    folder->tensors = std::move(renamed);
    notes->push_back("hf: the folder was saved from the base model (no '" + prefix + "' prefix); its tensors are "
                     "read as " + hf.architecture + "'s");
  }
  std::vector<std::string> skipped;
  for (const auto& [name, to] : hf.tied) {
    auto copy = folder->tensors.find(name);
    if (copy == folder->tensors.end()) continue;
    auto target = folder->tensors.find(to);
    const Tensor& a = copy->second.as_tensor();
    if (target == folder->tensors.end() || a.sizes != target->second.as_tensor().sizes ||
        a.storage->dtype != target->second.as_tensor().storage->dtype ||
        !SameElements(ShardOf(*folder, name), ShardOf(*folder, to), a.numel(), ElementSize(a.storage->dtype))) {
      return Status::InvalidInput(folder->Named(name) + " is not the same tensor as " + to + ", to which " +
                                  hf.architecture + " ties it; the folder holds an untied model this "
                                  "architecture does not compute");
    }
    skipped.push_back(name + " (tied to " + to + ")");
    folder->tensors.erase(copy);
  }
  for (const std::string& pattern : hf.ignore) {
    const HfNameTemplate ignored(pattern);
    for (auto it = folder->tensors.begin(); it != folder->tensors.end();) {
      std::string block;
      if (!ignored.Match(it->first, &block)) {
        ++it;
        continue;
      }
      if (skipped.empty() || skipped.back() != pattern) skipped.push_back(pattern);
      it = folder->tensors.erase(it);
    }
  }
  if (!skipped.empty()) {
    notes->push_back("hf: skipped what " + hf.architecture + " recomputes or ties when it loads: " + Join(skipped, ", "));
  }
  return Status::Ok();
}

// ---- canonical tensors -> layers ------------------------------------------------

// Where the HF names for `canonical` would be, for the message when they are missing.
std::string HfNamesOf(const HfExport& hf, const std::string& canonical) {
  for (const HfTensorMap& map : hf.tensors) {
    std::string block, expert;
    if (!HfNameTemplate(map.from).Match(canonical, &block, &expert)) continue;
    std::vector<std::string> names;
    for (const std::string& to : map.to) names.push_back(HfNameTemplate(to).With(block, expert));
    return Join(names, ", ");
  }
  return "";
}

// The experts per layer the folder's tensors hold (0: none), which the
// config must give as the rules read it (args.num_moe_experts), when it does.
Status RecordExperts(int64_t experts, const std::string& config_path, const RuleInputs& inputs, Value* metadata) {
  if (experts == 0) return Status::Ok();
  const std::optional<int64_t> recorded = MetaRef{{"args.num_moe_experts"}}.Resolve(inputs);
  if (recorded && *recorded != experts) {
    return Status::InvalidInput(config_path + " gives " + std::to_string(*recorded) + " experts per layer "
                                "(args.num_moe_experts), and the folder holds the tensors of " +
                                std::to_string(experts) + "; the config does not describe these weights");
  }
  SetPath(metadata, "args.num_moe_experts", Value::Int(experts));
  return Status::Ok();
}

// The vocabulary rows: those of the first vocabulary-split tensor.
int64_t VocabRows(const LogicalCheckpoint& ckpt) {
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->policy == ParamRule::Policy::kVocab) return t.full_shape[0];
    }
  }
  return 0;
}

// A config.json vocab_size beyond the embedding's rows names tokens the
// model has no row for (an embedding padded beyond it is what exports write).
Status CheckConfigVocab(const Value& config, const std::string& config_path, int64_t rows) {
  const Value* vocab = Find(config, "vocab_size");
  if (vocab == nullptr || !vocab->is(Value::Kind::kInt) || vocab->as_int() <= rows) return Status::Ok();
  return Status::InvalidInput(config_path + " has vocab_size " + std::to_string(vocab->as_int()) +
                              ", more than the " + std::to_string(rows) + " rows of the folder's embedding; "
                              "the config does not describe these weights");
}

DType WeightDType(const HfFolder& folder) {
  for (const auto& [name, v] : folder.tensors) {
    if (IsFloatingPoint(v.as_tensor().storage->dtype)) return v.as_tensor().storage->dtype;
  }
  return DType::kFloat32;
}


// The architecture values config.json records, by its own names (GPT-2's
// n_layer as well as Llama's num_hidden_layers), in this order.
RecordedFacts ConfigFacts(const Value& config) {
  static const char* kArchitectureFields[] = {
      "architectures",       "model_type", "num_hidden_layers", "n_layer",           "hidden_size", "n_embd",
      "intermediate_size",   "n_inner",    "num_attention_heads", "n_head",          "num_key_value_heads",
      "head_dim",            "vocab_size", "max_position_embeddings", "n_positions", "rms_norm_eps",
      "layer_norm_epsilon",  "rope_theta", "torch_dtype",       "tie_word_embeddings", "num_local_experts",
      "num_experts_per_tok"};
  RecordedFacts facts;
  for (const char* field : kArchitectureFields) {
    if (const Value* v = Find(config, field)) facts.emplace_back(field, v->DebugString(60));
  }
  return facts;
}

}  // namespace

Result<HfImport> ImportHfModel(HfFolder folder, const RuleSet& rules, const CommonOptions& options) {
  const std::string config_path = folder.config_label.empty() ? folder.files.front() : folder.config_label;
  const HfExport& hf = *rules.section<HfExport>();
  HfImport out;
  RESHARD_RETURN_IF_ERROR(NameAsArchitecture(hf, &folder, &out.notes));
  LogicalCheckpoint& ckpt = out.logical;
  RESHARD_ASSIGN_OR_RETURN(ckpt.settings, SettingsValue(options.set));
  ckpt.metadata.push_back(UntrainedRunMetadata());
  ConfigReader reader{folder.config, config_path, folder.config_fix.empty() ? "add it to config.json or give" : folder.config_fix,
                      rules, ckpt.settings, &ckpt.metadata[0], &out.notes};
  for (const HfConfigField& field : hf.config) RESHARD_RETURN_IF_ERROR(reader.Field(field));
  reader.Satisfy(hf.requirements);
  reader.Satisfy(rules.detect().args);
  RESHARD_RETURN_IF_ERROR(reader.Check(hf.requirements, hf.architecture + " (hf.requires of " + rules.origin() + ")"));
  RESHARD_RETURN_IF_ERROR(reader.Check(rules.detect().args, "rule set " + rules.name() + " (its detect.args)"));
  SetImportedLayoutArgs(WeightDType(folder), &ckpt.metadata[0]);
  SetUntrainedCounters(&ckpt.metadata[0]);
  const std::vector<std::string> multiple = rules.vocab_divisible_by().Paths();
  if (const Value* given = multiple.empty() ? nullptr : reader.inputs().Find(multiple.front())) {
    // Recorded, as a run records it, so that the next conversion of the output knows it.
    SetPath(&ckpt.metadata[0], multiple.front(), *given);
  } else if (!multiple.empty()) {
    SetPath(&ckpt.metadata[0], multiple.front(), Value::Int(kMegatronVocabMultiple));
    out.notes.push_back("hf: the vocabulary is padded to a multiple of " + std::to_string(kMegatronVocabMultiple) +
                        " x TP, Megatron's default; give another with --set " + multiple.front().substr(
                        multiple.front().rfind('.') + 1) + "=N (what the training run will pass as "
                        "--make-vocab-size-divisible-by)");
  }

  const std::optional<int64_t> blocks = MetaRef{{"args.num_layers"}}.Resolve(reader.inputs());
  if (!blocks || *blocks < 1) {
    return Status::InvalidInput(config_path + " gives no layer count that rule set " + rules.name() + " reads as "
                                "args.num_layers; give it with --set num_layers=N");
  }
  TensorJoiner joiner(folder, rules, reader.inputs());
  RESHARD_ASSIGN_OR_RETURN(auto joined, joiner.JoinAll());
  // Checked before the layer list is sized by it.
  if (*blocks != joiner.block_count()) {
    return Status::InvalidInput(config_path + " gives " + std::to_string(*blocks) + " layers (args.num_layers "
                                "as rule set " + rules.name() + " reads it), and the folder holds the tensors of " +
                                std::to_string(joiner.block_count()) + " blocks; the config does not describe "
                                "these weights");
  }
  RESHARD_RETURN_IF_ERROR(RecordExperts(joiner.expert_count(), config_path, reader.inputs(), &ckpt.metadata[0]));
  ImportedRuns runs;
  auto hf_names = [&hf](const std::string& name) { return HfNamesOf(hf, name); };
  RESHARD_ASSIGN_OR_RETURN(ckpt.layers, LayOutImported(rules, *blocks, joiner.expert_count(), joined, hf_names,
                                                       folder.Label(), &runs));
  ckpt.vocab.padding_stripped = true;
  RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(options.rules.empty() ? rules.name() : options.rules, options.set, &ckpt));
  AttachImportedRuns(std::move(runs), &ckpt);
  RESHARD_RETURN_IF_ERROR(CheckConfigVocab(folder.config, config_path, VocabRows(ckpt)));
  SetImportedVocab(rules, VocabRows(ckpt), VocabRows(ckpt), &ckpt.metadata[0]);
  out.files = folder.files;
  out.what = "HF folder (" + hf.architecture + ", " + std::to_string(folder.files.size() - 1) + " weight file" +
             (folder.files.size() == 2 ? "" : "s") +
             (joiner.transposed_bytes() > 0 ? ", " + std::to_string(joiner.transposed_bytes() >> 20) +
                                                  " MiB of transposed matrices held in memory"
                                            : "") + ")";
  return out;
}

Result<std::map<std::string, ImportedTensor>> JoinHfTensors(const HfFolder& folder, const RuleSet& rules,
                                                           const RuleInputs& inputs) {
  return TensorJoiner(folder, rules, inputs).JoinAll();
}

Result<HfImport> ReadHfImport(const std::string& dir, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(HfFolder folder, ReadHfFolder(dir));
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> families, Families(folder.config, folder.files.front(), options.rules));
  // The first family whose model the folder holds (a tied Llama has no
  // lm_head the untied family needs); else the best family's refusal.
  Status refusal = Status::Ok();
  for (const RuleSet& rules : families) {
    Result<HfImport> imported = ImportHfModel(folder, rules, options);
    if (imported.ok()) {
      imported->facts = ConfigFacts(folder.config);
      imported->facts.emplace_back("weight files", std::to_string(folder.files.size() - 1));
      return imported;
    }
    if (refusal.ok()) refusal = imported.status();
  }
  return refusal;
}

}  // namespace reshard
