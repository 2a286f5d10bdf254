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
//   hf                          the Hugging Face transformers architecture the
//                               family exports to: conditions, config.json
//                               fields, and canonical name -> HF name(s) with
//                               their reordering (HfExport below)
//   torch_dist                  canonical name -> Megatron-Core key, for reading
//                               and writing the family as `torch_dist`, and the
//                               keys of Megatron-LM's `torch` format for each
//                               layer spec (TorchDistLayout)
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
// Names are templates whose only placeholder is {block}.
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

// What `export --to hf` writes for the family.
struct HfExport {
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

// One tensor of a torchtitan checkpoint (`torchtitan.tensors`): the HF
// tensor of the family's hf section it is, under torchtitan's key (several:
// alternatives, as torchtitan versions name it; the first is written).
struct TorchtitanTensor {
  int line = 0;
  std::string hf;                 // 'model.layers.{block}.self_attn.q_proj.weight'
  std::vector<std::string> keys;  // 'layers.{block}.attention.wq.weight', ...
  // The heads of a q or k projection whose rows torchtitan keeps as
  // interleaved rotary pairs (row 2i, 2i+1 of a head are HF's rows i and
  // hd/2 + i): a torchtitan.config expression; "" when the rows are HF's.
  std::string interleaved_heads;
  // How torchtitan's TP plan places it on the TP mesh (`tp`): Shard(tp_dim)
  // (a ColwiseParallel Linear's and any Embedding's 0, a RowwiseParallel
  // Linear's 1), each TP rank a run of whole `tp_blocks` (a torchtitan.config
  // expression, the heads; "": single rows or columns); -1: Replicate()
  // (SequenceParallel's norms).
  int tp_dim = -1;
  std::string tp_blocks;
};

// How torchtitan stores the family (`torchtitan`): the HF model under other
// keys. It records no model config: `config` gives config.json's fields as
// expressions of the tensors' sizes (torchtitan_config.h), literals, or
// nothing (then --set must).
struct TorchtitanLayout {
  int line = 0;
  std::vector<std::pair<std::string, std::string>> config;  // config.json key -> expression
  std::vector<TorchtitanTensor> tensors;
  // Keys (templates with {block}) of buffers torchtitan recomputes when it
  // loads (freqs_cis): an import skips them.
  std::vector<std::string> ignore;
};

// One args value a torch_dist import records under the name these rules
// read (`torch_dist.args`): Megatron-Core's args name some values otherwise
// (num_query_groups for num_key_value_heads). Read from `from` (a metadata
// path), or the literal `value`, when `when` holds.
struct TorchDistArg {
  int line = 0;
  std::string set;   // the args field the rules read
  std::string from;  // "" when `value` gives it
  std::shared_ptr<const Value> value;
  ArgConditions when;
};

// One canonical tensor of a Megatron-Core `torch_dist` checkpoint
// (`torch_dist.tensors`): a name with {block} is one tensor per transformer
// block, stacked in the checkpoint on a leading layer axis; one with
// {expert} too is one per block and expert, the experts stacked on the axis
// after the layer axis (the one expert parallelism splits).
struct TorchDistTensor {
  int line = 0;
  std::string name;               // canonical: 'layers.{block}.self_attention.dense.weight'
  std::vector<std::string> keys;  // the checkpoint's key; alternatives, as Megatron-Core versions name it
  // The key of the local layer spec's module (`local:`), when it is not
  // keys[0]: Transformer Engine fuses the norms into the linear layers
  // (`linear_qkv.layer_norm_weight`), the local spec keeps them as modules
  // (`input_layernorm.weight`). Also the last of `keys`, for reading.
  std::string local_key;
  // The canonical tensor's shape, as hf.tensors writes one (N, path, N*path,
  // *). A path the checkpoint does not record takes the size it meets first.
  std::vector<std::string> shape;
};

// Megatron-Core's layer specs, whose modules name some tensors differently.
enum class LayerSpec { kLocal, kTransformerEngine };

// The Megatron-LM args fields that say how a run split its layers over the
// pipeline stages (the first and last stage's layers, the embedding and the
// loss counted as layers), which a torch_dist import reads beside a
// section's args: its optimizer state's layout follows them.
inline constexpr const char* kPipelineSplitArgs[] = {
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"};

// How the family's models are stored by Megatron-Core's `torch_dist`, and
// the keys of Megatron-LM's `torch` format (one state_dict() per rank).
struct TorchDistLayout {
  int line = 0;
  std::vector<TorchDistArg> args;
  std::vector<TorchDistTensor> tensors;
  // The modules (keys without `._extra_state`, stacked like block tensors)
  // whose per-layer `_extra_state` Megatron-Core saves and loads: written
  // empty by a torch_dist target, as a model without Transformer Engine's
  // FP8 state holds it.
  std::vector<std::string> extra_state;
  // The same for the experts' modules (`expert_extra_state`), saved per
  // layer and expert (SequentialMLP's local experts).
  std::vector<std::string> expert_extra_state;
  // `optimizer_order`: the order in which the model registers its parameters
  // (Megatron's `named_parameters()`), by checkpoint key, which no checkpoint
  // records and the distributed optimizer's flat `dp_reshardable` buffers
  // follow (reversed). The keys of block tensors form one run: a layer's
  // parameters, repeated for every layer of a pipeline stage, between the
  // keys of the first stage and those of the last. Alternative keys of one
  // tensor stand at its place. Empty when the section gives none.
  std::vector<std::string> optimizer_order;
  // Megatron-LM's `torch` format keeps every module's `_extra_state`, so
  // more than torch_dist: Megatron-Core's own modules that torch_dist drops
  // (`torch_extra_state`: the output layer), and in the TE spec Transformer
  // Engine's other modules (`te_extra_state`: attention, final norm).
  std::vector<std::string> torch_extra_state;
  std::vector<std::string> te_extra_state;
  // The key of the last stage's copy of a tied word embedding (PP > 1), in
  // the `torch` format; empty when the family has no tied embedding.
  std::string tied_head;

  // The key `tensor` is held under by `spec`'s modules (stacked: no layer index).
  static const std::string& KeyOf(const TorchDistTensor& tensor, LayerSpec spec) {
    return spec == LayerSpec::kLocal && !tensor.local_key.empty() ? tensor.local_key : tensor.keys.front();
  }
  // Whether `key` is a key (any alternative) of a block tensor: one stacked
  // over the layers.
  bool IsStackedKey(const std::string& key) const;
  // Whether `key` is a key of an expert's tensor: stacked over the layers
  // and, on the axis after, the experts.
  bool IsExpertKey(const std::string& key) const;
};

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
  // The HF export, when the file declares one.
  const HfExport* hf() const { return hf_ ? &*hf_ : nullptr; }
  // The `torch_dist` section, when the file declares one.
  const TorchDistLayout* torch_dist() const { return torch_dist_ ? &*torch_dist_ : nullptr; }
  // The `torchtitan` section, when the file declares one (it needs hf).
  const TorchtitanLayout* torchtitan() const { return torchtitan_ ? &*torchtitan_ : nullptr; }

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
  std::optional<HfExport> hf_;
  std::optional<TorchDistLayout> torch_dist_;
  std::optional<TorchtitanLayout> torchtitan_;
};

}  // namespace reshard
