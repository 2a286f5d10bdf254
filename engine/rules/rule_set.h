// RuleSet: a model family's declarative description, read from a YAML file.
//
// A rule set tells reshard three things about a Megatron-DeepSpeed model
// family: the pipeline spec list (which positions own a `layer_NN` file and
// what kind of layer they are), how each tensor in a layer file is laid out
// across tensor-parallel ranks, and where the sizes it depends on live in the
// checkpoint's metadata. Adding a model family means writing one of these
// files; see docs/rules.md for the guide and a worked example.
//
// Format (every field documented; `#` comments allowed):
//
//   name: megatron-gpt2                      # unique, used by --rules NAME
//   description: GPT-2 style models of microsoft/Megatron-DeepSpeed
//   detect:                                  # auto-detection; all conditions must hold
//     metadata_keys: [universal_checkpoint_info]   # keys present in mp_rank files
//     absent_metadata_keys: [checkpoint_info]      # keys that must be absent
//     args: {swiglu: false, glu_activation: null}  # args values; null: absent or None,
//                                                  # '*': present and not None,
//                                                  # '!x': anything but x
//   pipeline:
//     # The PipelineModule spec list. Each entry is `role: ClassName`.
//     # `function` and `tied_head` own no file; `block` repeats
//     # args.num_layers times; every other role owns one layer file whose
//     # tensors are described under `layers.<role>`. A layer file's id is
//     # its entry's position in this list. Several numberings may be given
//     # as a map of name -> list; the one matching the files is used.
//     specs:
//       current: [{function: _to_float16}, {embedding: EmbeddingPipe},
//                 {block: ParallelTransformerLayerPipe}, {final_norm: MixedFusedLayerNorm},
//                 {tied_head: EmbeddingPipe}, {function: float16_to_fp32}]
//     partition_method: {arg: pp_partition_method, default: "type:transformer"}
//     tied_module: embed              # optimizer names tied_modules.embed.<key>
//   vocab:
//     original_size: [checkpoint_info.original_vocab_size, universal_checkpoint_info.original_vocab_size]
//     divisible_by: [args.make_vocab_size_divisible_by]
//     pad_to: [args.pad_vocab_size_to]        # optional explicit padded size
//   optimizer_groups: decay_no_decay          # or split_decay (BigScience: decay halves)
//   layers:
//     embedding:
//       - key: 'word_embeddings\.weight'     # RE2, full match on the file's key
//         split: vocab                       # vocab-parallel rows with padding
//         tied: true                         # also owned by the tied head
//       - key: 'word_embeddings\.norm\.(weight|bias)'
//         replicated: true
//         optional: true                     # present only in some configurations
//     block:
//       - key: 'self_attention\.query_key_value\.(weight|bias)'
//         split: {dim: 0, blocks: [args.num_key_value_heads, args.num_attention_heads]}
//       - key: 'mlp\.dense_h_to_4h\.(weight|bias)'
//         split: {dim: 0, parts: 2}          # SwiGLU: [gate; up] in every shard
//       - key: 'self_attention\.dense\.weight'
//         split: row                         # = {dim: 1}
//       - key: 'self_attention\.rotary_emb\.inv_freq'
//         replicated: {drift: first}         # per-rule drift policy
//         buffer: true                       # not a parameter: no optimizer state
//
// `split:` is column (= {dim: 0}), row (= {dim: 1}), vocab (= {vocab: true}:
// dim 0 with vocabulary padding) or a map {dim, parts, blocks, vocab};
// `replicated:` is true or a map {drift: check|average|first}.
//
// Sizes (`blocks`, vocab entries) are lists of alternatives; each is an
// integer or a dotted path into the mp_rank metadata (`args.<field>`); the
// first one present and not None is used.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reshard/reshard.h"
#include "reshard/status.h"

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

// A size taken from the checkpoint's metadata: alternatives tried in order.
struct MetaRef {
  std::vector<std::string> alternatives;  // "12" or "args.num_attention_heads"
  bool empty() const { return alternatives.empty(); }
  // Resolves against an mp_rank file's root dict. Nullopt when no alternative
  // is present; `tried` then lists them for the message.
  std::optional<int64_t> Resolve(const Value& metadata) const;
  // The first path alternative present and not None, whatever its kind (for
  // string settings such as the partition method); integers are skipped.
  const Value* Lookup(const Value& metadata) const;
  std::string ToString() const;
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

  // "split dim 0 (2 parts, blocks args.num_attention_heads)", "replicated", "vocab".
  std::string Describe() const;
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
  // `args.<partition_method.arg>` (read it with Lookup); empty when not set.
  const MetaRef& partition_method_arg() const { return partition_method_arg_; }
  const std::string& partition_method_default() const { return partition_method_default_; }
  const std::string& tied_module() const { return tied_module_; }

  const MetaRef& vocab_original_size() const { return vocab_original_size_; }
  const MetaRef& vocab_divisible_by() const { return vocab_divisible_by_; }
  const MetaRef& vocab_pad_to() const { return vocab_pad_to_; }
  OptimizerGroups optimizer_groups() const { return optimizer_groups_; }

  // Roles with layer files, and their rules in file order.
  const std::map<std::string, std::vector<ParamRule>>& layers() const { return layers_; }

  // The rule whose pattern fully matches `key` in a file of `role`.
  // Returns nullptr when none matches; an error when more than one does.
  Result<const ParamRule*> Match(const std::string& role, const std::string& key) const;

 private:
  friend class RuleSetParser;
  std::string name_, description_, origin_;
  DetectRule detect_;
  std::map<std::string, std::vector<SpecEntry>> numberings_;
  MetaRef partition_method_arg_;
  std::string partition_method_default_ = "type:transformer";
  std::string tied_module_;
  MetaRef vocab_original_size_, vocab_divisible_by_, vocab_pad_to_;
  OptimizerGroups optimizer_groups_ = OptimizerGroups::kDecayNoDecay;
  std::map<std::string, std::vector<ParamRule>> layers_;
};

// The rule files shipped in rules/ (found next to the binary's source tree or
// in RESHARD_RULES_DIR), loaded and validated.
Result<std::vector<RuleSet>> LoadBuiltinRuleSets();

// `spec` is a path to a YAML file or the name of a built-in rule set.
Result<RuleSet> LoadRuleSet(const std::string& spec);

}  // namespace reshard
