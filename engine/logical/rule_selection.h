// Choosing the rule set and the pipeline numbering that explain a checkpoint.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rules/rule_set.h"

namespace reshard {

struct LogicalCheckpoint;

struct RuleChoice {
  std::shared_ptr<const RuleSet> rules;
  std::string numbering;         // name of the matching spec list
  std::vector<SpecEntry> specs;  // that list with `block` expanded; index = layer id
};

// `spec` names a rule file or built-in rule set; empty = auto-detect among the
// built-in ones: a rule set fits when its `detect` conditions hold, one of its
// spec lists produces exactly the checkpoint's layer ids, and its rules
// explain every key. Exactly one must fit; when none explains every key but
// exactly one matches the metadata and the numbering, it is chosen and the
// keys it does not explain become findings.
// REQUIRES: ckpt's files, metadata and layer roots are loaded.
Result<RuleChoice> ChooseRuleSet(const LogicalCheckpoint& ckpt, const std::string& spec);

// The spec list `specs` with `block` repeated `num_blocks` times.
std::vector<SpecEntry> ExpandSpecs(const std::vector<SpecEntry>& specs, int64_t num_blocks);

}  // namespace reshard
