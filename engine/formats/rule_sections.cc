// The table of rule-file sections (rules/rule_section.h): which format
// parses which section of a rule file. A file of its own, beside the
// registry, so that what parses rule files (and its fuzzer) links the
// sections' parsers without every format.
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/torchtitan_rules.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "rules/rule_section.h"

namespace reshard {

const std::vector<RuleSectionParser>& RuleSectionParsers() {
  // hf before torchtitan, which maps the hf section's tensors.
  static const std::vector<RuleSectionParser> sections = {
      {HfExport::kName, ParseHfSection},
      {TorchDistLayout::kName, ParseTorchDistSection},
      {TorchtitanLayout::kName, ParseTorchtitanSection},
  };
  return sections;
}

}  // namespace reshard
