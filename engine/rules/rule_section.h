// RuleSection: a format's own section of a rule file (`hf:`, `torch_dist:`,
// `torchtitan:`): how the family's tensors and values appear in that format.
//
// This floor parses a rule file's core, what every format shares (the
// family's tensors, their canonical names and tensor-parallel layout); the
// format that owns a section parses it, in its own folder. The formats'
// registry hands this floor the table of section parsers
// (RuleSectionParsers, declared here and defined beside the registry, in
// formats/rule_sections.cc of the same engine library), so that the rules
// floor names no format and a new format's section touches no file here.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace reshard {

struct Field;
class RuleReader;
class RuleSet;

class RuleSection {
 public:
  virtual ~RuleSection() = default;
  // Adds every metadata path the section reads a value from: the keys
  // `--set` may give (RuleSet::ValuePaths).
  virtual void AddValuePaths(std::set<std::string>* paths) const = 0;
};

// How one section is parsed: `parse` reads the section's YAML, reports every
// problem through `in` (the rule file then fails to load) and returns what
// it read, or null when the section is unusable. `so_far` is the rule set
// with its core and the sections listed before this one.
struct RuleSectionParser {
  const char* name;  // the top-level key: "hf"
  std::shared_ptr<const RuleSection> (*parse)(const Field& section, const RuleSet& so_far, RuleReader* in);
};

// Every format's section, in the order they are parsed.
const std::vector<RuleSectionParser>& RuleSectionParsers();

}  // namespace reshard
