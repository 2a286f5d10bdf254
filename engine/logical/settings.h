// Settings: values the rules need that a checkpoint does not record, given
// on the command line as `--set path=value`.
//
// A rule reads each value from the first of its alternatives that gives one
// (rules/rule_set.h, MetaRef): a metadata path is read from the checkpoint's
// metadata and, where the metadata does not record it, from the settings; a
// literal number in the rule file is a constant or, after paths, the
// fallback. A few values of the run no rule reads are written by the exports
// (RunValuePaths). A setting never overrides what the checkpoint records: one
// that contradicts it, or that neither a rule nor an export reads, is refused.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>

#include "pickle/value.h"
#include "reshard/status.h"
#include "rules/rule_set.h"

namespace reshard {

// The settings as a dict of the metadata's shape: "args.num_attention_heads"
// = "4" becomes {"args": {"num_attention_heads": 4}}. A key without a dot
// means args.<key>; values are ints, true/false, numbers or strings.
Result<Value> SettingsValue(const std::map<std::string, std::string>& set);

// The values of the run that no rule reads but an export writes, which
// --set may give: the learning-rate schedule's bounds (args.lr, args.min_lr),
// which Megatron-Core's optimizer load pairs saved param groups by, and the
// global batch (args.global_batch_size) its scheduler counts samples by.
const std::set<std::string>& RunValuePaths();

// Refuses settings that neither `rules` nor an export reads (RunValuePaths),
// or that contradict `metadata` (numbers compared as numbers).
Status CheckSettings(const Value& settings, const RuleSet& rules, const Value& metadata);

// Refuses any setting for a checkpoint read without rules (no layer files),
// where nothing would read it.
Status RefuseSettings(const std::map<std::string, std::string>& set);

// A scalar as YAML writes it: true, 3, 0.5, alibi (an enum member: its name,
// or its value when it was pickled by value).
std::string ScalarText(const Value& v);

// Sets `value` at dotted `path` inside `root` (dict-like), making the dicts on the way.
void SetPath(Value* root, const std::string& path, Value value);

// A value for which ArgHolds(field, expected) holds, when the condition
// names one: the scalar, the first of "x|y", false for "!true", true for
// "!false"; nullopt for "null", "*" and other negations.
std::optional<Value> ValueThatHolds(const std::string& expected);

// Whether args.<field> is as `expected` says (the detect.args syntax of
// rules/rule_set.h: a scalar, "null", "*", "x|y" for either, or "!x" for
// anything but), read from the metadata, then the settings. An enum member
// reads as its name or, pickled by value, its value.
bool ArgHolds(const RuleInputs& inputs, const std::string& field, const std::string& expected);

// The first of `conditions` that does not hold, as "args.x is not y" (or
// "args.x is y" for a negation); empty when all hold.
std::string ArgsMismatch(const RuleInputs& inputs, const ArgConditions& conditions);

}  // namespace reshard
