// reshard::ListRuleSets and reshard::CheckRuleFile: the `rules` command.
#include "reshard/reshard.h"
#include "rules/rule_set.h"

namespace reshard {
namespace {

RuleSetInfo InfoOf(const RuleSet& r) { return {r.name(), r.description(), r.origin()}; }

}  // namespace

Result<std::vector<RuleSetInfo>> ListRuleSets() {
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  std::vector<RuleSetInfo> out;
  for (const RuleSet& r : all) out.push_back(InfoOf(r));
  return out;
}

Result<RuleSetInfo> CheckRuleFile(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(RuleSet r, RuleSet::LoadFile(path));
  return InfoOf(r);
}

}  // namespace reshard
