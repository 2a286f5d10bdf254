// The rule model: drift policy names, metadata sizes, rule descriptions and
// key matching. Parsing is in rule_parser.cc.
#include "rules/rule_set.h"

#include <re2/re2.h>

#include "pickle/value.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Walks a dotted path through dict-like values (dict, OrderedDict, Namespace).
// Null when a step is missing or None.
const Value* WalkPath(const Value& root, const std::string& path) {
  const Value* v = &root;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    v = Find(*v, path.substr(start, dot == std::string::npos ? dot : dot - start));
    if (v == nullptr || v->is_none()) return nullptr;
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

}  // namespace

const char* DriftPolicyName(DriftPolicy p) {
  switch (p) {
    case DriftPolicy::kCheck: return "check";
    case DriftPolicy::kAverage: return "average";
    case DriftPolicy::kFirst: return "first";
  }
  return "?";
}

std::optional<DriftPolicy> ParseDriftPolicy(const std::string& s) {
  for (DriftPolicy p : {DriftPolicy::kCheck, DriftPolicy::kAverage, DriftPolicy::kFirst}) {
    if (s == DriftPolicyName(p)) return p;
  }
  return std::nullopt;
}

std::optional<int64_t> MetaRef::Resolve(const Value& metadata) const {
  for (const std::string& alt : alternatives) {
    int64_t n = 0;
    if (ParseInt(alt, &n)) return n;
    const Value* v = WalkPath(metadata, alt);
    if (v != nullptr && ReadInt(*v, &n)) return n;
  }
  return std::nullopt;
}

const Value* MetaRef::Lookup(const Value& metadata) const {
  for (const std::string& alt : alternatives) {
    int64_t unused = 0;
    if (ParseInt(alt, &unused)) continue;
    if (const Value* v = WalkPath(metadata, alt)) return v;
  }
  return nullptr;
}

std::string MetaRef::ToString() const {
  if (alternatives.size() == 1) return alternatives[0];
  return "[" + Join(alternatives, ", ") + "]";
}

std::string ParamRule::Describe() const {
  switch (policy) {
    case Policy::kVocab: return "vocab";
    case Policy::kReplicated:
      if (!drift) return "replicated";
      return std::string("replicated (drift ") + DriftPolicyName(*drift) + ")";
    case Policy::kSplit: break;
  }
  std::vector<std::string> details;
  if (parts > 1) details.push_back(std::to_string(parts) + " parts");
  if (!blocks.empty()) details.push_back("blocks " + blocks.ToString());
  std::string out = "split dim " + std::to_string(dim);
  return details.empty() ? out : out + " (" + Join(details, ", ") + ")";
}

Result<const ParamRule*> RuleSet::Match(const std::string& role, const std::string& key) const {
  const ParamRule* found = nullptr;
  auto it = layers_.find(role);
  if (it == layers_.end()) return found;
  for (const ParamRule& rule : it->second) {
    if (!RE2::FullMatch(key, *rule.key_regex)) continue;
    if (found != nullptr) {
      return Status::RuleError(origin_ + ": key '" + key + "' in " + role + " files matches rules at lines " +
                               std::to_string(found->line) + " and " + std::to_string(rule.line) +
                               "; make the patterns disjoint");
    }
    found = &rule;
  }
  return found;
}

}  // namespace reshard
