#include "logical/logical_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <string_view>

#include "logical/rule_selection.h"
#include "logical/settings.h"
#include "logical/tp_placement.h"
#include "rules/builtin_rules.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

void AddError(LogicalCheckpoint* ckpt, std::string message) { ckpt->AddError(std::move(message)); }

// "rules/megatron-gpt2.yaml:40", to point at the rule behind a finding.
std::string RuleWhere(const RuleSet& rules, const ParamRule& rule) {
  return rules.origin() + ":" + std::to_string(rule.line);
}

// Keys of TP rank `t`'s file, in order.
std::vector<std::string> KeysOf(const Value& root) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : *DictItems(root)) {
    keys.push_back(k.is(Value::Kind::kString) ? k.as_string() : k.DebugString());
  }
  return keys;
}

// Checks one tensor of one layer across ranks and fills its full shape.
// Returns false (after adding findings) when it cannot be reshaped.
bool DescribeTensor(const LogicalLayer& layer, LogicalCheckpoint* ckpt, LogicalTensor* lt) {
  const std::string& label = lt->label;
  for (size_t t = 0; t < layer.roots.size(); ++t) {
    const Value* v = Find(layer.roots[t], lt->key);
    if (v == nullptr || !v->is(Value::Kind::kTensor)) {
      AddError(ckpt, label + " is missing or not a tensor on TP rank " + std::to_string(t));
      return false;
    }
    const Tensor& tensor = v->as_tensor();
    if (!tensor.IsContiguous() || tensor.storage == nullptr ||
        tensor.storage_offset + tensor.numel() > tensor.storage->numel) {
      AddError(ckpt, label + " on TP rank " + std::to_string(t) +
                         " is not a contiguous view of its storage; reshard cannot read it");
      return false;
    }
    if (t == 0) {
      lt->dtype = tensor.storage->dtype;
      lt->local_shape = tensor.sizes;
    } else if (tensor.storage->dtype != lt->dtype || tensor.sizes != lt->local_shape) {
      AddError(ckpt, "inconsistent shapes across TP ranks: " + label + " is " +
                         DTypeName(lt->dtype) + ShapeString(lt->local_shape) + " on rank 0 but " +
                         DTypeName(tensor.storage->dtype) + ShapeString(tensor.sizes) +
                         " on rank " + std::to_string(t));
      return false;
    }
    lt->shards.push_back(SourceShard::Of(tensor, ShardCoords{static_cast<int>(t)}));
  }
  const ParamRule& rule = *lt->rule;
  lt->full_shape = lt->local_shape;
  if (rule.policy == ParamRule::Policy::kReplicated) return true;
  const int dim = rule.dim;
  if (dim >= static_cast<int>(lt->local_shape.size())) {
    AddError(ckpt, label + " has " + std::to_string(lt->local_shape.size()) +
                       " dimension(s) but its rule (" + RuleWhere(*ckpt->rules, rule) + ") splits dim " +
                       std::to_string(dim));
    return false;
  }
  lt->full_shape[dim] *= ckpt->tp;
  if (lt->local_shape[dim] % rule.parts != 0) {
    AddError(ckpt, label + ": dim " + std::to_string(dim) + " of size " +
                       std::to_string(lt->local_shape[dim]) + " does not hold " +
                       std::to_string(rule.parts) + " equal parts (" + RuleWhere(*ckpt->rules, rule) + ")");
    return false;
  }
  if (!rule.blocks.empty()) {
    std::optional<int64_t> blocks = rule.blocks.Resolve(ckpt->inputs());
    if (!blocks || *blocks <= 0) {
      // Once per value, not once per tensor that needs it.
      const std::string message = kMissingBlockCount + rule.blocks.ToString() + " (first needed by " +
                                  label + ") is " + rule.blocks.HowToGive();
      const std::string prefix = message.substr(0, message.find(" (first"));
      const bool reported = std::any_of(ckpt->findings.begin(), ckpt->findings.end(),
                                        [&](const Finding& f) { return f.message.rfind(prefix, 0) == 0; });
      if (!reported) AddError(ckpt, message);
      return false;
    }
    lt->blocks = *blocks;
    lt->blocks_from = rule.blocks.ResolvedFrom(ckpt->inputs());
    const int64_t part = lt->full_shape[dim] / rule.parts;
    if (part % lt->blocks != 0 || lt->blocks % ckpt->tp != 0) {
      AddError(ckpt, label + ": " + std::to_string(part) + " rows per part do not form " + BlocksPhrase(*lt) +
                         " spread evenly over " + std::to_string(ckpt->tp) + " TP ranks");
      return false;
    }
  }
  return true;
}

// The 0-based transformer block spec `id` is, or -1 when it is not a block.
int BlockIndex(const LogicalCheckpoint& ckpt, int id) {
  if (ckpt.specs[id].role != "block") return -1;
  int block = 0;
  for (int i = 0; i < id; ++i) block += ckpt.specs[i].role == "block" ? 1 : 0;
  return block;
}

// Two tensors of one checkpoint never share a canonical name: verify and
// the exports address tensors by it.
void CheckNamesUnique(LogicalCheckpoint* ckpt) {
  std::map<std::string, const LogicalTensor*> seen;
  for (const LogicalLayer& layer : ckpt->layers) {
    for (const LogicalTensor& t : layer.tensors) {
      auto [it, inserted] = seen.emplace(t.name, &t);
      if (!inserted) {
        AddError(ckpt, t.label + " and " + it->second->label + " get the same canonical name '" +
                           t.name + "'; give one of their rules another `name:` template in " +
                           ckpt->rules->origin());
      }
    }
  }
}

// A DeepSpeed MoE block: one with tensors of MoE rules (the gate, experts).
bool IsMoeLayer(const LogicalLayer& layer) {
  return std::any_of(layer.tensors.begin(), layer.tensors.end(), [](const LogicalTensor& t) { return t.rule->MoeOnly(); });
}

// `key` as a rule's regex: its metacharacters escaped, and an index (a
// component of digits, such as an expert's number) any number, so that one
// rule explains every file and index holding it.
std::string KeyPattern(const std::string& key) {
  std::string pattern;
  for (size_t i = 0; i < key.size(); ++i) {
    const bool component_start = i == 0 || key[i - 1] == '.';
    size_t end = i;
    while (end < key.size() && std::isdigit(static_cast<unsigned char>(key[end]))) ++end;
    if (component_start && end > i && (end == key.size() || key[end] == '.')) {
      pattern += "\\d+";
      i = end - 1;
      continue;
    }
    if (std::string_view(".[]{}()*+?^$|\\").find(key[i]) != std::string_view::npos) pattern += '\\';
    pattern += key[i];
  }
  return pattern;
}

// Keys no rule matches, one entry per role and pattern however many files
// hold them: a user adds one rule for each.
struct UnknownKey {
  std::string first;  // the first file's key, as messages name it
  int files = 0;
};
using UnknownKeys = std::map<std::pair<std::string, std::string>, UnknownKey>;  // (role, pattern) ->

// One finding per unknown key pattern, saying where to add its rule: in a
// copy of a built-in rule file (never the file itself, which an upgrade
// replaces), else in the user's own.
void ReportUnknownKeys(const UnknownKeys& unknown, LogicalCheckpoint* ckpt) {
  const RuleSet& rules = *ckpt->rules;
  const std::string where = IsBuiltinRuleFile(rules.origin())
                                ? " of a copy of " + rules.origin() + " (give the copy a name: of its own and pass it "
                                  "with --rules FILE)"
                                : " in " + rules.origin();
  for (const auto& [role_pattern, key] : unknown) {
    const auto& [role, pattern] = role_pattern;
    const std::string more = key.files > 1 ? "; also in " + Count(key.files - 1, "more " + role + " file") : "";
    AddError(ckpt, "unknown key " + key.first + " (a " + role + " file" + more + "): no rule of '" + rules.name() +
                       "' matches it; add one under layers." + role + where + ", e.g. `- key: '" + pattern +
                       "'` with split or replicated");
  }
}

// Matches every key of a layer against the rule set; reports required
// rules no key matched, and adds the keys no rule matches to `unknown`.
// Returns whether the rules explain the layer without a finding.
bool DescribeLayer(LogicalLayer* layer, LogicalCheckpoint* ckpt, UnknownKeys* unknown) {
  const RuleSet& rules = *ckpt->rules;
  const size_t findings_before = ckpt->findings.size();
  bool all_known = true;
  const std::vector<std::string> keys = KeysOf(layer->roots[0]);
  for (size_t t = 1; t < layer->roots.size(); ++t) {
    if (KeysOf(layer->roots[t]) != keys) {
      AddError(ckpt, layer->label + " files hold different keys on TP rank 0 and TP rank " +
                         std::to_string(t) + "; the checkpoint is inconsistent");
      return false;
    }
  }
  std::set<const ParamRule*> used;
  for (const std::string& key : keys) {
    Result<const ParamRule*> rule = rules.Match(layer->role, key);
    if (!rule.ok()) {
      AddError(ckpt, layer->TensorLabel(key) + ": " + rule.status().message());
      continue;
    }
    if (*rule == nullptr) {
      UnknownKey& entry = (*unknown)[{layer->role, KeyPattern(key)}];
      if (entry.files++ == 0) entry.first = layer->TensorLabel(key);
      all_known = false;
      continue;
    }
    used.insert(*rule);
    LogicalTensor lt;
    lt.key = key;
    lt.label = layer->TensorLabel(key);
    lt.name = (*rule)->CanonicalName(key, layer->id, BlockIndex(*ckpt, layer->id));
    lt.rule = *rule;
    if (!DescribeTensor(*layer, ckpt, &lt)) continue;
    for (SourceShard& shard : lt.shards) {
      shard.placements = PlaceTpRank(*lt.rule, lt.full_shape, ckpt->tp, shard.at.tp).placements;
    }
    layer->tensors.push_back(std::move(lt));
  }
  auto it = rules.layers().find(layer->role);
  if (it == rules.layers().end()) return all_known && ckpt->findings.size() == findings_before;
  const bool moe = IsMoeLayer(*layer);
  for (const ParamRule& rule : it->second) {
    if (rule.RequiredIn(moe) && !used.count(&rule)) {
      AddError(ckpt, "missing key: " + layer->label + " (a " + layer->role +
                         " file) has no key matching '" + rule.key_pattern + "', which " +
                         RuleWhere(*ckpt->rules, rule) + " requires; mark the rule optional if the model "
                         "may lack it");
    }
  }
  return all_known && ckpt->findings.size() == findings_before;
}

// The first key of `a` that `b` lacks; empty when there is none.
std::string FirstMissing(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  for (const std::string& k : a) {
    if (std::find(b.begin(), b.end(), k) == b.end()) return k;
  }
  return "";
}

// Files of one role (every block, say) hold the same keys: a key missing from
// one of them means a damaged file, even where the rule is optional or also
// matches another key. MoE blocks are compared with MoE blocks, the others
// with the others. `clean` are the layers whose keys the rules explain (the
// others have findings already).
void CheckSameKeysPerRole(const std::set<int>& clean, LogicalCheckpoint* ckpt) {
  std::map<std::string, const LogicalLayer*> first_of_role;
  for (const LogicalLayer& layer : ckpt->layers) {
    if (!clean.count(layer.id)) continue;
    auto [first, inserted] = first_of_role.emplace(layer.role + (IsMoeLayer(layer) ? " (MoE)" : ""), &layer);
    if (inserted) continue;
    const std::vector<std::string> want = KeysOf(first->second->roots[0]);
    const std::vector<std::string> have = KeysOf(layer.roots[0]);
    if (want == have) continue;
    const std::string here = layer.label + " (a " + layer.role + " file)";
    const std::string there = first->second->label;
    if (std::string k = FirstMissing(want, have); !k.empty()) {
      AddError(ckpt, here + " lacks " + k + ", which " + there + " has; the file is damaged");
    } else if (std::string k = FirstMissing(have, want); !k.empty()) {
      AddError(ckpt, here + " has " + k + ", which " + there + " lacks; the checkpoint mixes models");
    } else {
      AddError(ckpt, here + " holds the keys of " + there + " in another order");
    }
  }
}

// ---- vocabulary ----------------------------------------------------------------

void DescribeVocab(LogicalCheckpoint* ckpt) {
  const RuleSet& rules = *ckpt->rules;
  const RuleInputs inputs = ckpt->inputs();
  for (const LogicalLayer& layer : ckpt->layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->policy != ParamRule::Policy::kVocab) continue;
      if (ckpt->vocab.padded_rows == 0) {
        ckpt->vocab.padded_rows = t.full_shape[0];
      } else if (ckpt->vocab.padded_rows != t.full_shape[0]) {
        AddError(ckpt, "vocabulary tensors disagree: " + t.label + " has " +
                           std::to_string(t.full_shape[0]) + " rows, others " +
                           std::to_string(ckpt->vocab.padded_rows));
      }
    }
  }
  ckpt->vocab.original_size = rules.vocab_original_size().Resolve(inputs);
  ckpt->vocab.divisible_by = rules.vocab_divisible_by().Resolve(inputs);
  ckpt->vocab.pad_to = rules.vocab_pad_to().Resolve(inputs);
  if (ckpt->vocab.padded_rows == 0) return;
  const int64_t recorded = MetadataInt(ckpt->args(), "padded_vocab_size", -1);
  if (ckpt->vocab.padding_stripped) {
    if (!ckpt->vocab.original_size) ckpt->vocab.original_size = ckpt->vocab.padded_rows;
    if (*ckpt->vocab.original_size != ckpt->vocab.padded_rows) {
      AddError(ckpt, "the vocabulary tensors hold " + std::to_string(ckpt->vocab.padded_rows) +
                         " rows without padding, but the recorded vocabulary size is " +
                         std::to_string(*ckpt->vocab.original_size));
    }
  } else if (recorded >= 0 && recorded != ckpt->vocab.padded_rows) {
    AddError(ckpt, "args.padded_vocab_size is " + std::to_string(recorded) +
                       " but the vocabulary tensors have " +
                       std::to_string(ckpt->vocab.padded_rows) + " rows");
  }
  if (ckpt->vocab.original_size && *ckpt->vocab.original_size > ckpt->vocab.padded_rows) {
    AddError(ckpt, "the recorded vocabulary size " + std::to_string(*ckpt->vocab.original_size) +
                       " exceeds the " + std::to_string(ckpt->vocab.padded_rows) +
                       " rows of the vocabulary tensors");
  }
}

void CheckBlockCount(LogicalCheckpoint* ckpt) {
  const int64_t blocks = std::count_if(ckpt->specs.begin(), ckpt->specs.end(),
                                       [](const SpecEntry& s) { return s.role == "block"; });
  const int64_t recorded = MetadataInt(ckpt->args(), "num_layers", -1);
  if (recorded >= 0 && recorded != blocks) {
    AddError(ckpt, "args.num_layers is " + std::to_string(recorded) + " but the checkpoint has " +
                       std::to_string(blocks) + " transformer-block files");
  }
}

}  // namespace

std::string BlocksPhrase(const LogicalTensor& t) {
  const std::string& from = t.blocks_from;
  // Megatron's names for what the blocks are, when the count comes from them.
  const bool kv = from.find("key_value_heads") != std::string::npos || from.find("query_groups") != std::string::npos;
  const bool heads = from.find("attention_heads") != std::string::npos;
  const std::string noun = kv ? "KV head" : heads ? "head" : "block";
  const std::string source = from.empty() ? t.rule->blocks.ToString() : from;
  return Count(t.blocks, noun) + " (" + source + ")";
}

int64_t MetadataInt(const Value& root, const char* key, int64_t fallback) {
  int64_t v = fallback;
  if (const Value* f = Find(root, key)) ReadInt(*f, &v);
  return v;
}

bool LogicalCheckpoint::HasErrors() const { return !FirstError().ok(); }

Status LogicalCheckpoint::FirstError() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return Status::InvalidInput(f.message);
  }
  return Status::Ok();
}

const Value& LogicalCheckpoint::args() const {
  static const Value kNone;
  const Value* a = metadata.empty() ? nullptr : Find(metadata[0], "args");
  return a != nullptr ? *a : kNone;
}

RuleInputs LogicalCheckpoint::inputs() const {
  static const Value kNone;
  return RuleInputs{metadata.empty() ? kNone : metadata[0], settings};
}

void LogicalCheckpoint::AddError(std::string message) {
  findings.push_back({Finding::Severity::kError, std::move(message)});
}

Status DescribeCheckpoint(const std::string& rules, const std::map<std::string, std::string>& set,
                          LogicalCheckpoint* ckpt) {
  RESHARD_ASSIGN_OR_RETURN(ckpt->settings, SettingsValue(set));
  RESHARD_ASSIGN_OR_RETURN(RuleChoice choice, ChooseRuleSet(*ckpt, rules));
  RESHARD_RETURN_IF_ERROR(CheckSettings(ckpt->settings, *choice.rules, ckpt->inputs().metadata));
  ckpt->rules = choice.rules;
  ckpt->numbering = choice.numbering;
  ckpt->specs = choice.specs;
  for (LogicalLayer& layer : ckpt->layers) layer.role = ckpt->specs[layer.id].role;
  CheckBlockCount(ckpt);
  std::set<int> clean;
  UnknownKeys unknown;
  for (LogicalLayer& layer : ckpt->layers) {
    if (DescribeLayer(&layer, ckpt, &unknown)) clean.insert(layer.id);
  }
  ReportUnknownKeys(unknown, ckpt);
  CheckSameKeysPerRole(clean, ckpt);
  CheckNamesUnique(ckpt);
  DescribeVocab(ckpt);
  return Status::Ok();
}

std::string VocabSummary(const VocabInfo& vocab) {
  if (vocab.padded_rows == 0) return "";
  std::string s = "; vocabulary " + std::to_string(vocab.padded_rows) +
                  (vocab.padding_stripped ? " rows (padding stripped)" : " padded rows");
  if (vocab.original_size) s += " (true size " + std::to_string(*vocab.original_size) + ")";
  return s;
}

}  // namespace reshard
