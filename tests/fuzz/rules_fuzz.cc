// libFuzzer target: the rule-file parser and validator on arbitrary YAML.
// Seeds: the built-in rule files (corpus/rules).
#include <cstddef>
#include <cstdint>
#include <string>

#include "rules/rule_set.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string yaml(reinterpret_cast<const char*>(data), size);
  (void)reshard::RuleSet::LoadString(yaml, "fuzz.yaml");
  return 0;
}
