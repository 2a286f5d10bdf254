// RuleSet: a model family's declarative description, read from a YAML file.
//
// A rule set tells reshard what it needs to know about a Megatron-DeepSpeed
// model family: the pipeline spec list (which positions own a `layer_NN` file
// and what kind of layer they are), how each tensor in a layer file is laid
// out across tensor-parallel ranks, where the sizes it depends on live in the
// checkpoint's metadata, and the canonical, layout-independent name of every
// tensor. Adding a model family means writing one of these files.
//
// docs/rules.md documents the format field by field, with a guide and a
// worked example. In short:
//
//   name, description, detect   what the set is called; which checkpoints it fits
//   pipeline                    spec list(s) of {role: ClassName}, partition method,
//                               tied module
//   vocab, optimizer_groups     where the vocabulary sizes are; optimizer group order
//   layers: {role: [rule]}      per tensor key (RE2, full match): split or
//                               replicated, canonical name, optional, tied, buffer,
//                               moe / expert (DeepSpeed MoE blocks, the expert axis)
//   module_paths                non-pipeline saves: the module path of each role
//   hf, torch_dist, torchtitan  a format's own section: how the family appears
//                               in that format, parsed by the format that owns
//                               it (rule_section.h; hf_common/hf_rules.h,
//                               megatron_core/common/torch_dist_rules.h,
//                               hf_common/torchtitan_rules.h under formats/)
//
// This header is the model. The parser (RuleSet::LoadFile, LoadString) is in
// rule_parser.cc; the files shipped in rules/ are found by builtin_rules.h.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "reshard/reshard.h"
#include "reshard/status.h"
#include "rules/builtin_rules.h"  // LoadRuleSet, for the callers that include only this header
#include "rules/rule_section.h"

namespace re2 {
class RE2;
}

namespace reshard {

class Value;

// What to do when TP-replicated copies of a tensor differ (the public
// ReplicatedPolicy: kCheck, kAverage, kFirst).
using DriftPolicy = ReplicatedPolicy;
const char* DriftPolicyName(DriftPolicy p);
std::optional<DriftPolicy> ParseDriftPolicy(const std::string& s);

// What rules read values from: the checkpoint's metadata (an mp_rank file's
// root dict), then the values given on the command line (`--set path=value`,
// a dict of the same shape) for what the metadata does not record.
struct RuleInputs {
  const Value& metadata;
  const Value& settings;
  // The value at dotted `path` ("args.num_attention_heads"); null when
  // neither records it (or records None).
  const Value* Find(const std::string& path) const;
};

// A value a rule needs: alternatives tried in order, each a metadata path
// (read through RuleInputs) or a literal number (a constant, or the fallback
// when it follows paths).
struct MetaRef {
  std::vector<std::string> alternatives;  // "12" or "args.num_attention_heads"
  bool empty() const { return alternatives.empty(); }
  // The first alternative that gives an integer; nullopt when none does.
  std::optional<int64_t> Resolve(const RuleInputs& inputs) const;
  // That alternative as written ("args.num_key_value_heads", "12"): what
  // messages name; "" when none gives an integer.
  std::string ResolvedFrom(const RuleInputs& inputs) const;
  // The first path alternative present, whatever its kind (for string
  // settings such as the partition method); literal numbers are skipped.
  const Value* Lookup(const RuleInputs& inputs) const;
  // The path alternatives, for messages and for checking --set keys.
  std::vector<std::string> Paths() const;
  std::string ToString() const;
  // Why the value is missing and the ways to give it: "not recorded in the
  // checkpoint metadata (args.x); give it as a fallback in the rule file
  // ([args.x, N]) or with --set args.x=N".
  std::string HowToGive() const;
};

// A scalar written as text (a YAML scalar, a --set value): an integer,
// true/false, a number, else the string itself.
Value ScalarValue(const std::string& text);

// Walks a dotted path through dict-like values (dict, OrderedDict, Namespace).
// Null when a step is missing or None.
const Value* WalkPath(const Value& root, const std::string& path);

// A piece of a canonical-name template: literal text or a placeholder.
struct NamePiece {
  enum class Kind { kText, kBlock, kLayer, kKey, kGroup };
  Kind kind = Kind::kText;
  std::string text;  // kText
  int group = 0;     // kGroup: capture group of the key regex, from 1
};

struct ParamRule {
  enum class Policy { kSplit, kVocab, kReplicated };

  std::string role;         // layer role this rule belongs to
  std::string key_pattern;  // as written in the file
  std::shared_ptr<re2::RE2> key_regex;
  int line = 0;             // line in the rule file, for messages

  Policy policy = Policy::kReplicated;
  int dim = 0;        // split dimension (kSplit; 0 for kVocab)
  int parts = 1;      // sub-parameters stacked along `dim` in every shard
  MetaRef blocks;     // indivisible units per part along `dim` (heads, KV groups)
  std::optional<DriftPolicy> drift;  // kReplicated: overrides the command-line policy
  bool optional = false;
  bool tied = false;    // also owned by the tied head on the last pipeline stage
  bool buffer = false;  // persistent buffer, not an optimizer parameter
  // DeepSpeed MoE blocks (`moe:`): the tensor is only in MoE blocks (true:
  // the gate), only in the other blocks (false: the dense MLP), or in any
  // (unset). `expert: N` (implies moe: true): one expert's tensor, capture
  // group N of the key is its global expert id, the axis experts are
  // regrouped along when the expert-parallel size changes.
  std::optional<bool> moe;
  int expert = 0;
  bool MoeOnly() const { return moe.value_or(false); }
  // Whether a block (a MoE block or not) must hold a tensor of this rule.
  bool RequiredIn(bool moe_block) const { return !optional && (!moe || *moe == moe_block); }

  // The canonical-name template as written (`name:`) or the default
  // (`layers.{block}.{key}` in block rules, `<role>.{key}` elsewhere), and
  // the same split at its placeholders.
  std::string name_template;
  std::vector<NamePiece> name_pieces;

  // "split dim 0 (2 parts, blocks args.num_attention_heads)", "replicated", "vocab".
  std::string Describe() const;

  // The canonical name of the tensor `key`, which this rule matches, in the
  // file of spec `layer_id`; `block` is the 0-based transformer block, -1
  // outside block rules. The parser rejects names that are the same for two
  // tensors whatever the keys are; names built from keys can still meet (a
  // name of one rule equal to the default of another), so code that uses
  // them as identities checks that those of one checkpoint are unique.
  std::string CanonicalName(const std::string& key, int layer_id, int block) const;
  // The global expert id in `key` (which this rule matches); -1 when the
  // rule has no expert axis.
  int ExpertId(const std::string& key) const;
  // `key` with its expert id replaced by `id` (an EP rank names its experts
  // by their local ids 0..E/EP-1). REQUIRES: expert > 0.
  std::string WithExpertId(const std::string& key, int id) const;
  // Where the expert id starts in `key`. REQUIRES: expert > 0.
  size_t ExpertIdOffset(const std::string& key) const;
};

// Where one role's tensors are in a non-pipeline (nn.Module) save, whose
// keys are module paths: `pattern` (RE2) matches the start of the path; a
// block's captures its 0-based block number. The rest of the path is the
// key the role's rules match.
struct ModulePath {
  std::string role;
  std::string pattern;
  std::shared_ptr<re2::RE2> regex;  // pattern followed by the key, as (?:pattern)(.*)
  int line = 0;
};

// One entry of the pipeline spec list.
struct SpecEntry {
  std::string role;        // "function", "embedding", "block", "final_norm", "tied_head", ...
  std::string class_name;  // matched by type:<regex> partition methods
  bool OwnsFile() const { return role != "function" && role != "tied_head"; }
};

struct DetectRule {
  std::vector<std::string> metadata_keys;
  std::vector<std::string> absent_metadata_keys;
  // args field -> expected YAML scalar rendered as string ("null", "true", "alibi", "3").
  std::map<std::string, std::string> args;
};

enum class OptimizerGroups { kDecayNoDecay, kSplitDecay };

// Conditions on `args` fields, as detect.args writes them: a YAML scalar,
// "null" (absent or None), "*" (present), "x|y" (either) or "!x" (anything
// but x).
using ArgConditions = std::map<std::string, std::string>;

// For RuleSection::AddValuePaths: the args paths `conditions` read, and the
// paths a shape's dims read (each N, path, N*path or *).
void AddConditionPaths(const ArgConditions& conditions, std::set<std::string>* paths);
void AddShapePaths(const std::vector<std::string>& shape, std::set<std::string>* paths);

class RuleSet {
 public:
  // Parses and validates a rule file. Errors name the file and line:
  // "rules/x.yaml:12: bad regex 'a(b': missing ): a(b".
  static Result<RuleSet> LoadFile(const std::string& path);
  static Result<RuleSet> LoadString(const std::string& yaml, const std::string& origin);

  const std::string& name() const { return name_; }
  const std::string& description() const { return description_; }
  const std::string& origin() const { return origin_; }
  const DetectRule& detect() const { return detect_; }

  // Named spec lists (a single list is named "default").
  const std::map<std::string, std::vector<SpecEntry>>& numberings() const { return numberings_; }
  // The numbering listed first: the one a checkpoint made from another
  // format (an HF folder) is written in.
  const std::string& first_numbering() const { return first_numbering_; }
  // `args.<partition_method.arg>` (read it with Lookup); empty when not set.
  const MetaRef& partition_method_arg() const { return partition_method_arg_; }
  const std::string& partition_method_default() const { return partition_method_default_; }
  const std::string& tied_module() const { return tied_module_; }
  // `pipeline.requires`: the args conditions under which the family's
  // Megatron-DeepSpeed model computes a checkpoint; a model that needs more
  // (Megatron-Core's RoPE scaling) is not written in its layout.
  const ArgConditions& pipeline_requirements() const { return pipeline_requirements_; }

  const MetaRef& vocab_original_size() const { return vocab_original_size_; }
  const MetaRef& vocab_divisible_by() const { return vocab_divisible_by_; }
  const MetaRef& vocab_pad_to() const { return vocab_pad_to_; }
  OptimizerGroups optimizer_groups() const { return optimizer_groups_; }

  // Roles with layer files, and their rules in file order.
  const std::map<std::string, std::vector<ParamRule>>& layers() const { return layers_; }
  // Non-pipeline saves' module paths, in file order (empty: the family has
  // no non-pipeline form).
  const std::vector<ModulePath>& module_paths() const { return module_paths_; }
  // The role, block (-1 outside blocks) and role-relative key of module path
  // `path`; false when no module path matches it.
  bool SplitModulePath(const std::string& path, std::string* role, int* block, std::string* key) const;
  // A format's own section (rule_section.h), when the file declares it:
  // `Section` is the RuleSection its format parses it into, named kName.
  template <class Section>
  const Section* section() const {
    auto it = sections_.find(Section::kName);
    return it == sections_.end() ? nullptr : dynamic_cast<const Section*>(it->second.get());
  }

  // Every metadata path a value is read from (sizes, vocabulary, partition
  // method, detection args): the keys `--set` may give.
  std::set<std::string> ValuePaths() const;

  // The rule whose pattern fully matches `key` in a file of `role`.
  // Returns nullptr when none matches; an error when more than one does.
  Result<const ParamRule*> Match(const std::string& role, const std::string& key) const;

 private:
  friend class RuleSetParser;
  std::string name_, description_, origin_;
  DetectRule detect_;
  std::map<std::string, std::vector<SpecEntry>> numberings_;
  std::string first_numbering_;
  MetaRef partition_method_arg_;
  std::string partition_method_default_ = "type:transformer";
  std::string tied_module_;
  ArgConditions pipeline_requirements_;
  MetaRef vocab_original_size_, vocab_divisible_by_, vocab_pad_to_;
  OptimizerGroups optimizer_groups_ = OptimizerGroups::kDecayNoDecay;
  std::map<std::string, std::vector<ParamRule>> layers_;
  std::vector<ModulePath> module_paths_;
  std::map<std::string, std::shared_ptr<const RuleSection>> sections_;  // by name
};

}  // namespace reshard
