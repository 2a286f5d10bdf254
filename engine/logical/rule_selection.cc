#include "logical/rule_selection.h"

#include <set>

#include "logical/logical_checkpoint.h"
#include "logical/settings.h"
#include "pickle/value.h"

namespace reshard {
namespace {

// Why `rules` does not apply to the checkpoint's metadata; empty when it does.
std::string DetectMismatch(const RuleSet& rules, const LogicalCheckpoint& ckpt) {
  const Value& meta = ckpt.metadata[0];
  for (const std::string& key : rules.detect().metadata_keys) {
    if (Find(meta, key) == nullptr) return "the metadata has no '" + key + "'";
  }
  for (const std::string& key : rules.detect().absent_metadata_keys) {
    if (Find(meta, key) != nullptr) return "the metadata has '" + key + "'";
  }
  return ArgsMismatch(ckpt.inputs(), rules.detect().args);
}

std::set<int> LayerIds(const LogicalCheckpoint& ckpt) {
  std::set<int> ids;
  for (const LogicalLayer& layer : ckpt.layers) ids.insert(layer.id);
  return ids;
}

std::set<int> FileIds(const std::vector<SpecEntry>& specs) {
  std::set<int> ids;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].OwnsFile()) ids.insert(static_cast<int>(i));
  }
  return ids;
}

// "1, 3-6, 8"
std::string RangesString(const std::set<int>& ids) {
  std::string out;
  for (auto it = ids.begin(); it != ids.end();) {
    int first = *it, last = *it;
    for (++it; it != ids.end() && *it == last + 1; ++it) last = *it;
    out += (out.empty() ? "" : ", ") + std::to_string(first);
    if (last != first) out += "-" + std::to_string(last);
  }
  return out;
}

int64_t BlockCount(const std::vector<SpecEntry>& specs, const LogicalCheckpoint& ckpt) {
  int64_t num_layers = -1;
  if (const Value* v = Find(ckpt.args(), "num_layers")) ReadInt(*v, &num_layers);
  // More blocks than layer files match no numbering, and would be expanded
  // into as many specs: the files are counted instead, and CheckBlockCount
  // (logical_checkpoint.cc) reports the recorded number.
  if (num_layers >= 0 && num_layers <= static_cast<int64_t>(ckpt.layers.size())) return num_layers;
  int64_t other_files = 0;
  for (const SpecEntry& s : specs) other_files += (s.OwnsFile() && s.role != "block") ? 1 : 0;
  return static_cast<int64_t>(ckpt.layers.size()) - other_files;
}

// The numbering of `rules` whose file ids equal the checkpoint's, if any.
bool MatchNumbering(const RuleSet& rules, const LogicalCheckpoint& ckpt, RuleChoice* choice,
                    std::string* why_not) {
  const std::set<int> have = LayerIds(ckpt);
  for (const auto& [name, specs] : rules.numberings()) {
    std::vector<SpecEntry> expanded = ExpandSpecs(specs, BlockCount(specs, ckpt));
    const std::set<int> want = FileIds(expanded);
    if (want == have) {
      choice->numbering = name;
      choice->specs = std::move(expanded);
      return true;
    }
    *why_not += (why_not->empty() ? "" : "; ") + std::string("numbering '") + name +
                "' expects layer ids " + RangesString(want);
  }
  return false;
}

// Counts the keys no rule explains plus the required rules nothing matches,
// looking at TP rank 0's files.
int KeyProblems(const RuleSet& rules, const RuleChoice& choice, const LogicalCheckpoint& ckpt) {
  int problems = 0;
  for (const LogicalLayer& layer : ckpt.layers) {
    const std::string& role = choice.specs[layer.id].role;
    std::set<const ParamRule*> used;
    bool moe = false;  // a MoE block: its MoE rules are required
    for (const auto& [k, v] : *DictItems(layer.roots[0])) {
      Result<const ParamRule*> rule =
          rules.Match(role, k.is(Value::Kind::kString) ? k.as_string() : "");
      if (!rule.ok() || *rule == nullptr) {
        ++problems;
      } else {
        used.insert(*rule);
        moe = moe || (*rule)->MoeOnly();
      }
    }
    auto it = rules.layers().find(role);
    if (it == rules.layers().end()) continue;
    for (const ParamRule& r : it->second) problems += (r.RequiredIn(moe) && !used.count(&r)) ? 1 : 0;
  }
  return problems;
}

Result<RuleChoice> UseRuleSet(std::shared_ptr<const RuleSet> rules, const LogicalCheckpoint& ckpt) {
  RuleChoice choice;
  std::string why_not;
  if (!MatchNumbering(*rules, ckpt, &choice, &why_not)) {
    return Status::RuleError("the layer files (ids " + RangesString(LayerIds(ckpt)) +
                             ") do not match rule set '" + rules->name() + "': " + why_not);
  }
  choice.rules = std::move(rules);
  return choice;
}

Result<RuleChoice> DetectRuleSet(const LogicalCheckpoint& ckpt) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  // `fits` explain every key; `near` match the metadata and the numbering but
  // not every key (their findings will name the keys).
  std::vector<RuleChoice> fits, near;
  std::string rejected;
  for (RuleSet& rules : all) {
    RuleChoice choice;
    std::string why_not = DetectMismatch(rules, ckpt);
    if (why_not.empty() && MatchNumbering(rules, ckpt, &choice, &why_not)) {
      const int problems = KeyProblems(rules, choice, ckpt);
      if (problems > 0) {
        rejected += (rejected.empty() ? "" : "; ") + rules.name() + ": " +
                    std::to_string(problems) + " key(s) unexplained";
      }
      choice.rules = std::make_shared<const RuleSet>(std::move(rules));
      (problems == 0 ? fits : near).push_back(std::move(choice));
      continue;
    }
    rejected += (rejected.empty() ? "" : "; ") + rules.name() + ": " + why_not;
  }
  if (fits.size() == 1) return std::move(fits[0]);
  if (fits.empty() && near.size() == 1) return std::move(near[0]);
  if (fits.empty()) {
    return Status::RuleError("no built-in rule set fits this checkpoint (" + rejected +
                             "); force one with --rules NAME (values it needs that the checkpoint does not record "
                             "can be given with --set), or write a rule file for it (docs/rules.md) and pass "
                             "--rules FILE");
  }
  std::string names;
  for (const RuleChoice& c : fits) names += (names.empty() ? "" : ", ") + c.rules->name();
  return Status::RuleError("several rule sets fit this checkpoint (" + names +
                           "); choose one with --rules NAME");
}

}  // namespace

std::vector<SpecEntry> ExpandSpecs(const std::vector<SpecEntry>& specs, int64_t num_blocks) {
  std::vector<SpecEntry> out;
  for (const SpecEntry& s : specs) {
    const int64_t copies = s.role == "block" ? num_blocks : 1;
    for (int64_t i = 0; i < copies; ++i) out.push_back(s);
  }
  return out;
}

Result<RuleChoice> ChooseRuleSet(const LogicalCheckpoint& ckpt, const std::string& spec) {
  if (spec.empty()) return DetectRuleSet(ckpt);
  RESHARD_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(spec));
  return UseRuleSet(std::make_shared<const RuleSet>(std::move(rules)), ckpt);
}

}  // namespace reshard
