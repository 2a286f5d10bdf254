// The `hf` section of a rule file (rules/rule_section.h): the Hugging Face
// transformers architecture a family is, its config.json fields, and each
// canonical tensor's HF name(s) with their reordering. Read by the HF import
// and export and by every format that keeps the HF model's names (torchtitan,
// the DCP recipe, Accelerate).
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rules/rule_reader.h"
#include "rules/rule_section.h"
#include "rules/rule_set.h"

namespace reshard {

// One config.json field of an HF export (`hf.config`).
struct HfConfigField {
  std::string key;  // the config.json key
  int line = 0;
  // The value: the first of `paths` the checkpoint (or --set) records, else
  // `literal`; or, with `cases`, the value of the first case that holds.
  std::vector<std::string> paths;
  std::shared_ptr<const Value> literal;  // null: none (a missing value is asked for)
  // What config.json's null (or an absent key) stands for, as a size (N,
  // path or N*path): transformers' GPT-2 reads n_inner null as 4 x n_embd.
  // The import records it at paths[0]; the export writes what is recorded.
  std::string null_means;  // "" when null means nothing of the kind
  // With a literal ({value: V, why_not: TEXT}): why a model with another
  // value is refused, told to the user with the refusal of an HF import.
  std::string why_not;
  struct Case {
    ArgConditions when;
    std::shared_ptr<const Value> value;  // a literal; null when `entries` give a mapping
    // A mapping's entries in file order (rope_scaling's factor read from a
    // metadata path, its other entries literals), each read as a field is.
    std::vector<HfConfigField> entries;
    // Why a config.json value that misses this case is refused (what the
    // target fixes), told with the refusal of an HF import.
    std::string why_not;
  };
  std::vector<Case> cases;
};

// One canonical tensor and the HF tensor(s) it becomes (`hf.tensors`).
// Names are templates whose placeholders are {block} and {expert}.
struct HfTensorMap {
  int line = 0;
  std::string from;             // canonical name: 'layers.{block}.mlp.dense_h_to_4h.weight'
  std::vector<std::string> to;  // HF name(s); several: dim 0 divided among them
  // How dim 0 is divided: `to`'s tensors in order of the halves
  // (split_halves: [first; second]), or the grouped fused QKV
  // [groups, heads/groups + 2, hd] (split_qkv: q, k, v; with one name in
  // `to`, the rows reordered to [q; k; v] in one tensor).
  enum class Split { kNone, kHalves, kQkv };
  Split split = Split::kNone;
  MetaRef groups, heads;  // split_qkv
  bool transpose = false;  // 2-D [out, in] -> [in, out] (GPT-2's Conv1D)
  // The shape the architecture needs the tensor in, when it fixes one the
  // checkpoint may not have (HF BLOOM's MLP is 4 x hidden): each dim an
  // integer, a metadata path, or N*path. Empty: any.
  std::vector<std::string> shape;
};

// The `hf` section: what `export --to hf` writes for the family, and how an
// HF folder of the family is read.
struct HfExport : RuleSection {
  static constexpr char kName[] = "hf";
  void AddValuePaths(std::set<std::string>* paths) const override;

  int line = 0;
  std::string architecture;      // "LlamaForCausalLM"
  ArgConditions requirements;    // `requires`: what the architecture computes
  std::vector<HfConfigField> config;  // in file order
  std::vector<HfTensorMap> tensors;
  // For reading HF folders (an import). transformers' base_model_prefix: a
  // folder saved from the base model names its tensors without "<prefix>.".
  std::string base_model_prefix;
  // Names (templates with {block}) of tensors some transformers versions
  // save and the model recomputes when it loads: an import skips them.
  std::vector<std::string> ignore;
  // HF name -> the HF name it is tied to (a tied head some savers write
  // out): an import checks that the two are equal and skips the first.
  std::vector<std::pair<std::string, std::string>> tied;
};

// Parses the section (RuleSectionParser::parse).
std::shared_ptr<const RuleSection> ParseHfSection(const Field& section, const RuleSet& so_far, RuleReader* in);

// Checks an HF name template (its placeholders {block} and, where `experts`,
// {expert}); returns the placeholders it uses ("{block}{expert}", "").
std::string HfPlaceholders(const Field& f, const std::string& name, bool experts, RuleReader* in);

}  // namespace reshard
