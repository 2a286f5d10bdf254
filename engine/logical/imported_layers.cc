#include "logical/imported_layers.h"

#include <re2/re2.h>

#include <set>

#include "logical/rule_selection.h"
#include "logical/settings.h"
#include "util/strings.h"

namespace reshard {
namespace {

// The key `rule` matches, when its pattern is a literal (one key only).
std::optional<std::string> LiteralKey(const ParamRule& rule) {
  std::string key;
  for (size_t i = 0; i < rule.key_pattern.size(); ++i) {
    if (rule.key_pattern[i] == '\\' && i + 1 < rule.key_pattern.size()) ++i;
    key += rule.key_pattern[i];
  }
  if (RE2::QuoteMeta(key) != rule.key_pattern) return std::nullopt;
  return key;
}

// The keys an expert rule names for `experts` experts: its pattern with its
// expert group, `(\d+)`, replaced by each id, when that makes it a literal.
std::optional<std::vector<std::string>> ExpertKeys(const ParamRule& rule, int64_t experts) {
  static const std::string kGroup = "(\\d+)";
  const size_t at = rule.key_pattern.find(kGroup);
  if (rule.expert != 1 || at == std::string::npos || experts <= 0) return std::nullopt;
  std::vector<std::string> keys;
  for (int64_t e = 0; e < experts; ++e) {
    ParamRule one = rule;
    one.key_pattern.replace(at, kGroup.size(), std::to_string(e));
    std::optional<std::string> key = LiteralKey(one);
    if (!key) return std::nullopt;
    keys.push_back(*key);
  }
  return keys;
}

std::string LayerLabel(size_t id) { return "layer_" + std::string(id < 10 ? "0" : "") + std::to_string(id); }

// One rule of a layer file of an imported model: the tensor it names.
struct ImportedRule {
  size_t id;             // the layer file's spec
  const ParamRule* rule;
  std::string key;       // the one key its pattern names
  std::string name;      // canonical
};

// Every layer file of `rules`' first numbering with `blocks` blocks (id,
// whether it owns a file) and the rules of those that do, in order; an
// expert rule names one tensor per expert.
Result<std::vector<std::pair<size_t, std::vector<ImportedRule>>>> ImportedRules(const RuleSet& rules, int64_t blocks,
                                                                                int64_t experts,
                                                                                const std::string& what) {
  const std::vector<SpecEntry> specs = ExpandSpecs(rules.numberings().at(rules.first_numbering()), blocks);
  std::vector<std::pair<size_t, std::vector<ImportedRule>>> out;
  int block = -1;
  for (size_t id = 0; id < specs.size(); ++id) {
    if (specs[id].role == "block") ++block;
    if (!specs[id].OwnsFile()) continue;
    out.emplace_back(id, std::vector<ImportedRule>{});
    auto role = rules.layers().find(specs[id].role);
    if (role == rules.layers().end()) continue;
    for (const ParamRule& rule : role->second) {
      std::optional<std::vector<std::string>> keys = ExpertKeys(rule, experts);
      if (!keys) {
        std::optional<std::string> key = LiteralKey(rule);
        if (key) keys = std::vector<std::string>{*key};
      }
      if (!keys) {
        return Status::Unsupported("rule set " + rules.name() + " matches " + specs[id].role + " keys with the "
                                   "pattern '" + rule.key_pattern + "' (line " + std::to_string(rule.line) +
                                   "), which names no one key; reading " + what + " needs literal keys" +
                                   (rule.expert > 0 ? " (an expert rule: literal but for its expert id, (\\d+), "
                                                      "capture group 1)" : ""));
      }
      for (const std::string& key : *keys) {
        std::string name = rule.CanonicalName(key, static_cast<int>(id), specs[id].role == "block" ? block : -1);
        out.back().second.push_back({id, &rule, key, std::move(name)});
      }
    }
  }
  return out;
}

}  // namespace

Result<std::vector<LogicalLayer>> LayOutImported(const RuleSet& rules, int64_t blocks, int64_t experts,
                                                 const std::map<std::string, ImportedTensor>& tensors,
                                                 const std::function<std::string(const std::string&)>& source_of,
                                                 const std::string& what, ImportedRuns* runs) {
  RESHARD_ASSIGN_OR_RETURN(auto files, ImportedRules(rules, blocks, experts, what));
  std::vector<LogicalLayer> layers;
  std::set<std::string> placed;
  for (const auto& [id, file_rules] : files) {
    Items items;
    std::map<std::string, std::string> key_labels;  // canonical names, not layer_NN/key
    for (const ImportedRule& r : file_rules) {
      const std::string stored = source_of(r.name);
      key_labels[r.key] = r.name + (stored.empty() || stored == r.name ? "" : " (from " + stored + ")");
      auto it = tensors.find(r.name);
      if (it == tensors.end()) {
        if (!r.rule->RequiredIn(experts > 0)) continue;  // with experts, every block is a MoE block
        return Status::InvalidInput(what + " lacks " + (stored.empty() ? r.name : stored) + ", which " + r.name +
                                    " of rule set " + rules.name() + " is made of" +
                                    (stored.empty() ? " (nothing is mapped to it)" : ""));
      }
      items.emplace_back(Value::String(r.key), it->second.tensor);
      if (it->second.runs) runs->emplace(std::make_pair(static_cast<int>(id), r.key), *it->second.runs);
      placed.insert(r.name);
    }
    LogicalLayer layer;
    layer.id = static_cast<int>(id);
    layer.label = LayerLabel(id);
    layer.roots.push_back(MakeOrderedDict(std::move(items)));
    layer.key_labels = std::move(key_labels);
    layers.push_back(std::move(layer));
  }
  for (const auto& [name, tensor] : tensors) {
    if (!placed.count(name)) {
      return Status::Unsupported(what + " makes " + name + ", which no layer of rule set " + rules.name() +
                                 " holds at " + Count(blocks, "block") + "; its layer count disagrees with the "
                                 "tensors, or the rules lack it");
    }
  }
  return layers;
}

Result<const ParamRule*> ImportedRuleOf(const RuleSet& rules, int64_t blocks, int64_t experts,
                                        const std::string& name, const std::string& what) {
  RESHARD_ASSIGN_OR_RETURN(auto files, ImportedRules(rules, blocks, experts, what));
  for (const auto& file : files) {
    for (const ImportedRule& r : file.second) {
      if (r.name == name) return r.rule;
    }
  }
  return Status::Unsupported(what + " holds " + name + ", which no layer of rule set " + rules.name() + " holds at " +
                             Count(blocks, "block"));
}

void SetImportedLayoutArgs(DType weights, Value* metadata) {
  for (const char* key : {"tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                          "world_size"}) {
    SetPath(metadata, std::string("args.") + key, Value::Int(1));
  }
  SetPath(metadata, "args.bf16", Value::Bool(weights == DType::kBFloat16));
  SetPath(metadata, "args.fp16", Value::Bool(weights == DType::kFloat16));
}

void SetImportedVocab(const RuleSet& rules, int64_t padded, std::optional<int64_t> original, Value* metadata) {
  for (const std::string& key : rules.detect().metadata_keys) {
    if (Find(*metadata, key) == nullptr) Set(*metadata, key, Value::MakeDict());
    // What Megatron-DeepSpeed writes beside the sizes (§9.2), also where the
    // true size was recorded there first (SetImportedVocabSize): no import's
    // format records it.
    const std::string version = key + ".universal_checkpoint_version";
    if (key == "universal_checkpoint_info" && WalkPath(*metadata, version) == nullptr) {
      SetPath(metadata, version, Value::Float(0.2));
    }
  }
  for (const std::string& path : rules.vocab_original_size().Paths()) {
    if (original) SetPath(metadata, path, Value::Int(*original));
    const size_t dot = path.rfind('.');
    if (dot != std::string::npos) SetPath(metadata, path.substr(0, dot) + ".padded_vocab_size", Value::Int(padded));
  }
  SetPath(metadata, "args.padded_vocab_size", Value::Int(padded));
}

void SetImportedVocabSize(const RuleSet& rules, int64_t size, Value* metadata) {
  for (const std::string& path : rules.vocab_original_size().Paths()) SetPath(metadata, path, Value::Int(size));
}

void AttachImportedRuns(ImportedRuns runs, LogicalCheckpoint* ckpt) {
  for (LogicalLayer& layer : ckpt->layers) {
    for (LogicalTensor& t : layer.tensors) {
      auto it = runs.find({layer.id, t.key});
      if (it != runs.end()) t.shards[0].runs = std::move(it->second.runs);
    }
  }
}

}  // namespace reshard
