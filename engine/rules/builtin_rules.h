// The built-in rule sets: the files shipped in rules/, and choosing a rule set
// by name or by path (--rules).
//
// The directory is the one named by the environment variable
// RESHARD_RULES_DIR when it is set and not empty, else the source tree's
// rules/ (compiled in) where it exists, else rules/ beside the binary or the
// Python module (a pip-installed package), else the installed copy
// (<prefix>/share/reshard/rules, `make install`).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

class RuleSet;

// Every *.yaml file of the rules directory, loaded and validated, in file
// name order. Fails on the first file that does not load and when two files
// use the same rule set name.
Result<std::vector<RuleSet>> LoadBuiltinRuleSets();

// Whether the rule file at `path` is one of the built-in rule sets (which a
// user copies to change, never edits: an upgrade replaces it).
bool IsBuiltinRuleFile(const std::string& path);

// `spec` is a path to a YAML file or the name of a built-in rule set.
Result<RuleSet> LoadRuleSet(const std::string& spec);

// A note when `spec` (--rules) is a rule file outside the built-in folder
// that keeps the name of a built-in rule set (a copy whose `name:` was not
// changed), which every message would then call it by; "" otherwise.
std::string CopiedBuiltinNameNote(const std::string& spec);

// The rule sets that may read a checkpoint through a section of theirs
// (torch_dist, torchtitan): `spec` (--rules) alone, refused when it has no
// `section` (`has` false; `what` names the checkpoint for the message); with
// no `spec`, every built-in set that has one.
Result<std::vector<RuleSet>> RuleSetsWithSection(const std::string& spec, const std::string& section,
                                                 const std::function<bool(const RuleSet&)>& has,
                                                 const std::string& what);

}  // namespace reshard
