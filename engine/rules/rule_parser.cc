// Parsing and validation of rule files: RuleSet::LoadFile and LoadString.
//
// The parser reports every problem it finds, one line each ("file:line: what;
// fix"), rather than stopping at the first: a rule-file author fixes them in
// one pass. The format is documented in docs/rules.md.
#include "rules/rule_set.h"

#include <re2/re2.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "container/regular_file.h"
#include "pickle/value.h"
#include "rules/size_expression.h"
#include "util/strings.h"

namespace reshard {
namespace {

bool IsIdentifier(const std::string& s) {
  static const RE2 re("[A-Za-z_][A-Za-z0-9_]*");
  return RE2::FullMatch(s, re);
}

// `args.num_attention_heads`: identifiers joined by dots.
bool IsDottedPath(const std::string& s) {
  static const RE2 re("[A-Za-z_][A-Za-z0-9_]*(\\.[A-Za-z_][A-Za-z0-9_]*)*");
  return RE2::FullMatch(s, re);
}

// A YAML node and the 1-based line it is on, for messages.
struct Field {
  YAML::Node node;
  int line = 0;
};

// The fields of one mapping, by name.
using Fields = std::map<std::string, Field>;

// yaml-cpp marks are 0-based and -1 for nodes it made up (absent values).
int LineOf(const YAML::Node& n, int fallback) {
  int line = n.Mark().line;
  return line >= 0 ? line + 1 : fallback;
}

const std::vector<std::string> kTopFields = {"name",  "description",      "detect", "pipeline",
                                             "vocab", "optimizer_groups", "layers", "module_paths",
                                             "hf",    "torch_dist",       "torchtitan"};
const std::vector<std::string> kDetectFields = {"metadata_keys", "absent_metadata_keys", "args"};
const std::vector<std::string> kPipelineFields = {"specs", "partition_method", "tied_module", "requires"};
const std::vector<std::string> kPartitionFields = {"arg", "default"};
const std::vector<std::string> kVocabFields = {"original_size", "divisible_by", "pad_to"};
const std::vector<std::string> kRuleFields = {"key",      "name", "split", "replicated",
                                               "optional", "tied", "buffer", "moe", "expert"};
const std::vector<std::string> kSplitFields = {"dim", "parts", "blocks", "vocab"};
const std::vector<std::string> kReplicatedFields = {"drift"};
const std::vector<std::string> kSplitNames = {"column", "row", "vocab"};
const std::vector<std::string> kHfFields = {"architecture", "requires", "config", "tensors",
                                            "base_model_prefix", "ignore", "tied"};
const std::vector<std::string> kHfTensorFields = {"from", "to", "split_halves", "split_qkv", "transpose", "shape"};
const std::vector<std::string> kHfQkvFields = {"groups", "heads"};
const std::vector<std::string> kHfCaseFields = {"when", "value", "why_not"};
const std::vector<std::string> kHfExplainedFields = {"value", "why_not"};
const std::vector<std::string> kTorchDistFields = {"args",       "tensors",           "extra_state", "optimizer_order",
                                                   "torch_extra_state", "te_extra_state", "tied_head",
                                                   "expert_extra_state"};
const std::vector<std::string> kTorchDistArgFields = {"from", "value", "when"};
const std::vector<std::string> kTorchDistTensorFields = {"name", "key", "local", "shape"};
const std::vector<std::string> kTorchtitanFields = {"config", "tensors", "ignore"};
const std::vector<std::string> kTorchtitanTensorFields = {"hf", "key", "interleaved_heads", "tp"};
const std::vector<std::string> kTorchtitanTpFields = {"dim", "blocks"};
// config.json keys the exporter writes itself, from the checkpoint's tensors.
const std::vector<std::string> kHfDerivedKeys = {"architectures", "vocab_size", "torch_dtype"};

}  // namespace

// ---- the parser --------------------------------------------------------------

class RuleSetParser {
 public:
  RuleSetParser(const std::string& origin, RuleSet* out) : origin_(origin), rs_(out) {}

  Status Parse(const std::string& yaml) {
    try {
      ParseTop(Field{YAML::Load(yaml), 1});
    } catch (const YAML::Exception& e) {
      Fail(e.mark.line + 1, "YAML syntax error: " + e.msg + "; check the indentation and quoting");
    }
    if (errors_.empty()) return Status::Ok();
    return Status::RuleError(Join(errors_, "\n"));
  }

 private:
  // ---- reporting and typed access ----

  void Fail(int line, const std::string& msg) {
    errors_.push_back(origin_ + (line > 0 ? ":" + std::to_string(line) : "") + ": " + msg);
  }
  void Fail(const Field& f, const std::string& msg) { Fail(f.line, msg); }

  // The entries of mapping `f`, reporting unknown (misspelt) and repeated
  // names. Nullopt when `f` is not a mapping.
  std::optional<Fields> ReadFields(const Field& f, const std::string& where,
                                   const std::vector<std::string>& allowed) {
    if (!f.node.IsMap()) {
      Fail(f, where + " must be a mapping with fields " + Join(allowed, ", "));
      return std::nullopt;
    }
    Fields fields;
    for (const auto& kv : f.node) {
      int line = LineOf(kv.first, f.line);
      std::string name = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        Fail(line, "unknown field '" + name + "' in " + where + "; " + Hint(name, allowed));
      } else if (auto it = fields.find(name); it != fields.end()) {
        Fail(line, "field '" + name + "' appears twice in " + where + " (first at line " +
                       std::to_string(it->second.line) + "); keep one");
      } else {
        fields[name] = Field{kv.second, line};
      }
    }
    return fields;
  }

  static const Field* Get(const Fields& fields, const std::string& name) {
    auto it = fields.find(name);
    return it == fields.end() ? nullptr : &it->second;
  }

  std::optional<std::string> ReadString(const Field& f, const std::string& what) {
    if (f.node.IsScalar()) return f.node.Scalar();
    Fail(f, what + " must be a string");
    return std::nullopt;
  }

  std::optional<bool> ReadBool(const Field& f, const std::string& what) {
    if (f.node.IsScalar() && (f.node.Scalar() == "true" || f.node.Scalar() == "false")) {
      return f.node.Scalar() == "true";
    }
    Fail(f, what + " must be true or false");
    return std::nullopt;
  }

  std::optional<int64_t> ReadInt(const Field& f, const std::string& what) {
    int64_t n = 0;
    if (f.node.IsScalar() && ParseInt(f.node.Scalar(), &n)) return n;
    Fail(f, what + " must be an integer");
    return std::nullopt;
  }

  // The items of a sequence, each with its own line.
  static std::vector<Field> Items(const Field& f) {
    std::vector<Field> items;
    for (const auto& item : f.node) items.push_back(Field{item, LineOf(item, f.line)});
    return items;
  }

  std::vector<std::string> ReadStringList(const Field& f, const std::string& what) {
    std::vector<std::string> out;
    if (!f.node.IsSequence()) {
      Fail(f, what + " must be a list of strings, e.g. [checkpoint_info]");
      return out;
    }
    for (const Field& item : Items(f)) {
      if (auto s = ReadString(item, what + " entry")) out.push_back(*s);
    }
    return out;
  }

  // An integer, a dotted metadata path, or a list of those (tried in order).
  MetaRef ReadMetaRef(const Field& f, const std::string& what) {
    MetaRef ref;
    std::vector<Field> items = f.node.IsSequence() ? Items(f) : std::vector<Field>{f};
    if (items.empty()) Fail(f, what + " is an empty list; give at least one size or path");
    for (const Field& item : items) {
      if (auto alternative = ReadSize(item, what)) ref.alternatives.push_back(*alternative);
    }
    return ref;
  }

  // One alternative of a size: a positive integer or a dotted path.
  std::optional<std::string> ReadSize(const Field& f, const std::string& what) {
    if (!f.node.IsScalar()) {
      Fail(f, what + " must be an integer, a path like args.num_attention_heads, or a list of those");
      return std::nullopt;
    }
    const std::string& s = f.node.Scalar();
    int64_t n = 0;
    if (ParseInt(s, &n) && n < 1) {
      Fail(f, what + " " + s + " must be positive");
    } else if (!ParseInt(s, &n) && !IsDottedPath(s)) {
      Fail(f, what + " '" + s + "' is neither an integer nor a dotted path like args.num_attention_heads");
    } else {
      return s;
    }
    return std::nullopt;
  }

  // ---- sections ----

  void ParseTop(const Field& root) {
    auto fields = ReadFields(root, "the top level of a rule file", kTopFields);
    if (!fields) return;
    if (const Field* f = Get(*fields, "name")) {
      ParseName(*f);
    } else {
      Fail(root, "missing 'name'; add name: <family>, the name used by --rules");
    }
    if (const Field* f = Get(*fields, "description")) {
      if (auto s = ReadString(*f, "description")) rs_->description_ = *s;
    }
    if (const Field* f = Get(*fields, "detect")) ParseDetect(*f);
    if (const Field* f = Get(*fields, "pipeline")) {
      ParsePipeline(*f);
    } else {
      Fail(root, "missing 'pipeline'; add pipeline.specs, the PipelineModule spec list");
    }
    if (const Field* f = Get(*fields, "vocab")) ParseVocab(*f);
    if (const Field* f = Get(*fields, "optimizer_groups")) ParseOptimizerGroups(*f);
    if (const Field* f = Get(*fields, "layers")) {
      ParseLayers(*f);
    } else {
      Fail(root, "missing 'layers'; add the tensor rules of every role that owns layer files");
    }
    if (const Field* f = Get(*fields, "module_paths")) ParseModulePaths(*f);
    if (const Field* f = Get(*fields, "hf")) ParseHf(*f);
    if (const Field* f = Get(*fields, "torch_dist")) ParseTorchDist(*f);
    if (const Field* f = Get(*fields, "torchtitan")) ParseTorchtitan(*f);
    CheckConsistency();
  }

  void ParseName(const Field& f) {
    static const RE2 re("[A-Za-z0-9][A-Za-z0-9._-]*");
    auto name = ReadString(f, "name");
    if (!name) return;
    if (!RE2::FullMatch(*name, re)) {
      Fail(f, "name '" + *name + "' must be letters, digits, '.', '_' or '-' (it is typed after --rules)");
      return;
    }
    rs_->name_ = *name;
  }

  void ParseDetect(const Field& f) {
    auto fields = ReadFields(f, "detect", kDetectFields);
    if (!fields) return;
    DetectRule& d = rs_->detect_;
    if (const Field* k = Get(*fields, "metadata_keys"))
      d.metadata_keys = ReadStringList(*k, "detect.metadata_keys");
    if (const Field* k = Get(*fields, "absent_metadata_keys")) {
      d.absent_metadata_keys = ReadStringList(*k, "detect.absent_metadata_keys");
    }
    if (const Field* a = Get(*fields, "args")) ParseDetectArgs(*a);
  }

  void ParseDetectArgs(const Field& f) {
    rs_->detect_.args = ReadArgConditions(f, "detect.args");
  }

  // A mapping of args field -> expected value (detect.args, hf.requires, a case's when).
  ArgConditions ReadArgConditions(const Field& f, const std::string& what) {
    ArgConditions out;
    if (!f.node.IsMap()) {
      Fail(f, what + " must be a mapping of args field -> value, e.g. {swiglu: true}");
      return out;
    }
    for (const auto& kv : f.node) {
      Field value{kv.second, LineOf(kv.first, f.line)};
      std::string name = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      if (!IsIdentifier(name)) {
        Fail(value, what + " key '" + name + "' must be an args field name");
      } else if (auto v = DetectValue(value.node)) {
        out[name] = *v;
      } else {
        Fail(value, what + "." + name + " must be a scalar, null (absent or None) or '*' (present, not None)");
      }
    }
    return out;
  }

  // detect.args values as the detector compares them: null spelled "null",
  // unquoted booleans spelled "true"/"false", anything else as written.
  static std::optional<std::string> DetectValue(const YAML::Node& n) {
    if (n.IsNull()) return "null";
    if (!n.IsScalar()) return std::nullopt;
    std::string s = n.Scalar();
    bool quoted = n.Tag() == "!";
    if (!quoted && (s == "True" || s == "TRUE")) return "true";
    if (!quoted && (s == "False" || s == "FALSE")) return "false";
    return s;
  }

  void ParsePipeline(const Field& f) {
    auto fields = ReadFields(f, "pipeline", kPipelineFields);
    if (!fields) return;
    if (const Field* specs = Get(*fields, "specs")) {
      ParseSpecs(*specs);
    } else {
      Fail(f, "missing pipeline.specs; list the PipelineModule specs as {role: ClassName}");
    }
    if (const Field* pm = Get(*fields, "partition_method")) ParsePartitionMethod(*pm);
    if (const Field* r = Get(*fields, "requires")) {
      rs_->pipeline_requirements_ = ReadArgConditions(*r, "pipeline.requires");
    }
    if (const Field* tm = Get(*fields, "tied_module")) {
      auto name = ReadString(*tm, "pipeline.tied_module");
      if (name && !IsIdentifier(*name)) {
        Fail(*tm, "pipeline.tied_module '" + *name + "' must be the TiedLayerSpec key, e.g. embed");
      } else if (name) {
        rs_->tied_module_ = *name;
        tied_module_line_ = tm->line;
      }
    }
  }

  void ParseSpecs(const Field& f) {
    if (f.node.IsSequence()) {
      AddNumbering("default", f);
      return;
    }
    if (!f.node.IsMap()) {
      Fail(f, "pipeline.specs must be a list of {role: ClassName}, or a map of numbering name -> list");
      return;
    }
    for (const auto& kv : f.node) {
      std::string name = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      Field list{kv.second, LineOf(kv.first, f.line)};
      if (!IsIdentifier(name)) {
        Fail(list, "numbering name '" + name + "' must be an identifier, e.g. current");
      } else if (rs_->numberings_.count(name)) {
        Fail(list, "numbering '" + name + "' appears twice in pipeline.specs; keep one");
      } else {
        AddNumbering(name, list);
      }
    }
  }

  void AddNumbering(const std::string& name, const Field& f) {
    if (!f.node.IsSequence() || f.node.size() == 0) {
      Fail(f, "spec list '" + name + "' must be a non-empty list of {role: ClassName}");
      return;
    }
    std::vector<SpecEntry> specs;
    int block_line = 0;
    for (const Field& item : Items(f)) {
      std::optional<SpecEntry> entry = ParseSpecEntry(item);
      if (!entry) continue;
      if (entry->role == "block" && block_line != 0) {
        Fail(item, "spec list '" + name + "' has a second block entry (first at line " +
                       std::to_string(block_line) +
                       "); write {block: ...} once, it stands for all args.num_layers blocks");
        continue;
      }
      if (entry->role == "block") block_line = item.line;
      specs.push_back(*entry);
    }
    if (block_line == 0) {
      Fail(f, "spec list '" + name + "' has no block entry; add {block: ParallelTransformerLayerPipe}");
    }
    if (rs_->first_numbering_.empty()) rs_->first_numbering_ = name;
    rs_->numberings_[name] = std::move(specs);
  }

  std::optional<SpecEntry> ParseSpecEntry(const Field& item) {
    if (!item.node.IsMap() || item.node.size() != 1) {
      Fail(item,
           "a spec entry must be a one-key map {role: ClassName}, e.g. {final_norm: MixedFusedLayerNorm}");
      return std::nullopt;
    }
    auto kv = *item.node.begin();
    SpecEntry entry;
    entry.role = kv.first.IsScalar() ? kv.first.Scalar() : "";
    if (!IsIdentifier(entry.role)) {
      Fail(item, "spec role '" + entry.role + "' must be an identifier, e.g. final_norm");
      return std::nullopt;
    }
    if (!kv.second.IsScalar() || kv.second.Scalar().empty()) {
      Fail(item, "spec entry '" + entry.role + "' needs the class or function name, e.g. {" + entry.role +
                     ": EmbeddingPipe}");
      return std::nullopt;
    }
    entry.class_name = kv.second.Scalar();
    int& first_line = entry.OwnsFile() ? owning_role_lines_[entry.role] : other_role_lines_[entry.role];
    if (first_line == 0) first_line = item.line;
    return entry;
  }

  void ParsePartitionMethod(const Field& f) {
    auto fields = ReadFields(f, "pipeline.partition_method", kPartitionFields);
    if (!fields) return;
    if (const Field* arg = Get(*fields, "arg")) {
      auto name = ReadString(*arg, "pipeline.partition_method.arg");
      if (name && !IsIdentifier(*name)) {
        Fail(*arg,
             "pipeline.partition_method.arg names an args field, e.g. pp_partition_method (no 'args.')");
      } else if (name) {
        rs_->partition_method_arg_.alternatives = {"args." + *name};
      }
    }
    if (const Field* def = Get(*fields, "default")) {
      static const RE2 re("uniform|parameters|type:.+");
      auto method = ReadString(*def, "pipeline.partition_method.default");
      if (method && !RE2::FullMatch(*method, re)) {
        Fail(*def, "unknown partition method '" + *method + "'; use uniform, parameters or type:<regex>");
      } else if (method) {
        rs_->partition_method_default_ = *method;
      }
    }
  }

  void ParseVocab(const Field& f) {
    auto fields = ReadFields(f, "vocab", kVocabFields);
    if (!fields) return;
    if (const Field* v = Get(*fields, "original_size")) {
      rs_->vocab_original_size_ = ReadMetaRef(*v, "vocab.original_size");
    }
    if (const Field* v = Get(*fields, "divisible_by")) {
      rs_->vocab_divisible_by_ = ReadMetaRef(*v, "vocab.divisible_by");
    }
    if (const Field* v = Get(*fields, "pad_to")) rs_->vocab_pad_to_ = ReadMetaRef(*v, "vocab.pad_to");
  }

  void ParseOptimizerGroups(const Field& f) {
    auto s = ReadString(f, "optimizer_groups");
    if (!s) return;
    if (*s == "decay_no_decay") {
      rs_->optimizer_groups_ = OptimizerGroups::kDecayNoDecay;
    } else if (*s == "split_decay") {
      rs_->optimizer_groups_ = OptimizerGroups::kSplitDecay;
    } else {
      Fail(f, "unknown optimizer_groups '" + *s +
                  "'; use decay_no_decay (MS: decay, no-decay) or split_decay (BS: decay halves, no-decay)");
    }
  }

  void ParseLayers(const Field& f) {
    if (!f.node.IsMap()) {
      Fail(f, "layers must be a mapping of role -> list of rules");
      return;
    }
    for (const auto& kv : f.node) {
      std::string role = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      Field rules{kv.second, LineOf(kv.first, f.line)};
      if (!IsIdentifier(role)) {
        Fail(rules, "layers role '" + role + "' must be an identifier, e.g. final_norm");
      } else if (layer_role_lines_.count(role)) {
        Fail(rules, "layers." + role + " appears twice (first at line " +
                        std::to_string(layer_role_lines_[role]) + "); merge the two lists");
      } else {
        layer_role_lines_[role] = rules.line;
        ParseRoleRules(role, rules);
      }
    }
  }

  void ParseRoleRules(const std::string& role, const Field& f) {
    if (!f.node.IsSequence() || f.node.size() == 0) {
      Fail(f, "layers." + role + " must be a non-empty list of rules ({key: ..., split: ...})");
      return;
    }
    std::vector<ParamRule>& rules = rs_->layers_[role];
    for (const Field& item : Items(f)) {
      std::optional<ParamRule> rule = ParseRule(role, item);
      if (!rule) continue;
      auto same = std::find_if(rules.begin(), rules.end(),
                               [&](const ParamRule& r) { return r.key_pattern == rule->key_pattern; });
      if (same != rules.end()) {
        Fail(item, "duplicate key pattern '" + rule->key_pattern + "' in layers." + role +
                       " (first at line " + std::to_string(same->line) + "); remove one");
        continue;
      }
      rules.push_back(std::move(*rule));
    }
  }

  std::optional<ParamRule> ParseRule(const std::string& role, const Field& f) {
    size_t errors_before = errors_.size();
    auto fields = ReadFields(f, "a layers." + role + " rule", kRuleFields);
    if (!fields) return std::nullopt;
    ParamRule rule;
    rule.role = role;
    rule.line = f.line;
    if (const Field* key = Get(*fields, "key")) {
      ParseKey(*key, &rule);
    } else {
      Fail(f, "rule without 'key'; add key: '<RE2 pattern of the tensor name>'");
    }
    // The name's capture groups are checked against the key's.
    if (rule.key_regex) ParseNameTemplate(Get(*fields, "name"), &rule);
    const Field* split = Get(*fields, "split");
    const Field* replicated = Get(*fields, "replicated");
    if (split && replicated) {
      Fail(f, "rule '" + rule.key_pattern + "' has both split and replicated; keep one");
    } else if (split) {
      ParseSplit(*split, &rule);
    } else if (replicated) {
      ParseReplicated(*replicated, &rule);
    } else {
      Fail(f, "rule '" + rule.key_pattern + "' has neither split nor replicated; " +
                  "add split: column|row|vocab|{dim: N} or replicated: true");
    }
    ParseFlag(*fields, "optional", &rule.optional);
    ParseFlag(*fields, "tied", &rule.tied);
    ParseFlag(*fields, "buffer", &rule.buffer);
    if (const Field* m = Get(*fields, "moe")) rule.moe = ReadBool(*m, "moe");
    if (const Field* e = Get(*fields, "expert")) ParseExpert(*e, &rule);
    if (errors_.size() != errors_before) return std::nullopt;
    return rule;
  }

  // `expert: N`: capture group N of the key is the global expert id.
  void ParseExpert(const Field& f, ParamRule* rule) {
    std::optional<int64_t> group = ReadInt(f, "expert");
    if (!group || !rule->key_regex) return;
    const int groups = rule->key_regex->NumberOfCapturingGroups();
    if (*group < 1 || *group > groups) {
      Fail(f, "expert: " + std::to_string(*group) + " is not a capture group of key '" + rule->key_pattern +
                  "' (it has " + std::to_string(groups) + "); put the expert id in parentheses, e.g. "
                  "experts\\.(\\d+)\\., and give its number");
      return;
    }
    if (rule->moe == false) Fail(f, "an expert rule is in MoE blocks only; remove moe: false");
    rule->expert = static_cast<int>(*group);
    rule->moe = true;
    const bool named = std::any_of(rule->name_pieces.begin(), rule->name_pieces.end(), [&](const NamePiece& p) {
      return p.kind == NamePiece::Kind::kKey || (p.kind == NamePiece::Kind::kGroup && p.group == rule->expert);
    });
    if (!named) {
      Fail(f, "name '" + rule->name_template + "' of an expert rule must hold the expert id {" +
                  std::to_string(rule->expert) + "}, or every expert gets the same name");
    }
  }

  // module_paths: {role: 'RE2 prefix'}; the block's prefix captures the block number.
  void ParseModulePaths(const Field& f) {
    if (!f.node.IsMap()) {
      Fail(f, "module_paths must be a mapping of role -> RE2 prefix of its module path");
      return;
    }
    for (const auto& kv : f.node) {
      ModulePath m;
      m.role = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      Field value{kv.second, LineOf(kv.first, f.line)};
      m.line = value.line;
      auto pattern = ReadString(value, "module_paths." + m.role);
      if (!pattern) continue;
      m.pattern = *pattern;
      RE2::Options options;
      options.set_log_errors(false);
      m.regex = std::make_shared<RE2>("(?:" + m.pattern + ")(.*)", options);
      const int want = m.role == "block" ? 1 : 0;
      if (!m.regex->ok()) {
        Fail(value, "bad regex '" + m.pattern + "': " + m.regex->error());
      } else if (m.regex->NumberOfCapturingGroups() - 1 != want) {
        Fail(value, "module_paths." + m.role + " '" + m.pattern + "' must have " +
                        (want ? "one capture group, the block number" : "no capture group") +
                        "; use (?:...) for grouping");
      } else {
        rs_->module_paths_.push_back(std::move(m));
      }
    }
  }

  void ParseKey(const Field& f, ParamRule* rule) {
    auto pattern = ReadString(f, "key");
    if (!pattern) return;
    rule->key_pattern = *pattern;
    RE2::Options options;
    options.set_log_errors(false);
    auto re = std::make_shared<RE2>(*pattern, options);
    if (!re->ok()) {
      Fail(f, "bad regex '" + *pattern + "': " + re->error());
      return;
    }
    rule->key_regex = std::move(re);
  }

  // `name:`, or the default when it is absent.
  void ParseNameTemplate(const Field* f, ParamRule* rule) {
    if (f == nullptr) {
      rule->name_template = rule->role == "block" ? "layers.{block}.{key}" : rule->role + ".{key}";
    } else if (f->node.IsScalar() && !f->node.Scalar().empty()) {
      rule->name_template = f->node.Scalar();
    } else {
      // Unquoted, `name: {key}` is a YAML mapping.
      Fail(*f, "name must be a non-empty string; quote a template that starts with '{', e.g. name: '{key}'");
      return;
    }
    int line = f ? f->line : rule->line;
    if (!SplitNameTemplate(line, rule)) return;
    if (rule->role == "block" && !NameUses(*rule, NamePiece::Kind::kBlock) &&
        !NameUses(*rule, NamePiece::Kind::kLayer)) {
      Fail(line, "name '" + rule->name_template + "' is the same in every block; add {block}, e.g. " +
                     "layers.{block}." + rule->name_template);
    }
  }

  // Splits the template at its placeholders into rule->name_pieces. Braces
  // have no other use, so an unmatched one is an error.
  bool SplitNameTemplate(int line, ParamRule* rule) {
    const std::string& t = rule->name_template;
    for (size_t pos = 0; pos < t.size();) {
      size_t brace = std::min(t.find_first_of("{}", pos), t.size());
      if (brace > pos) {
        rule->name_pieces.push_back({NamePiece::Kind::kText, t.substr(pos, brace - pos)});
        pos = brace;
        continue;
      }
      size_t close = t.find_first_of("{}", pos + 1);
      if (t[pos] == '}' || close == std::string::npos || t[close] == '{') {
        Fail(line, "name '" + t + "': the '" + t[pos] + "' at character " + std::to_string(pos + 1) +
                       " has no matching '" + (t[pos] == '{' ? "}" : "{") + "'; placeholders are " +
                       Join(Placeholders(*rule), ", "));
        return false;
      }
      std::optional<NamePiece> piece = ParsePlaceholder(line, t.substr(pos + 1, close - pos - 1), *rule);
      if (!piece) return false;
      rule->name_pieces.push_back(*piece);
      pos = close + 1;
    }
    return true;
  }

  // `word` is what stands between the braces.
  std::optional<NamePiece> ParsePlaceholder(int line, const std::string& word, const ParamRule& rule) {
    const std::string name = "name '" + rule.name_template + "'";
    int64_t group = 0;
    if (word == "block" && rule.role != "block") {
      Fail(line, name + " uses {block} in a layers." + rule.role +
                     " rule; only block rules have a block number, use {layer} or remove it");
    } else if (word == "block") {
      return NamePiece{NamePiece::Kind::kBlock};
    } else if (word == "layer") {
      return NamePiece{NamePiece::Kind::kLayer};
    } else if (word == "key") {
      return NamePiece{NamePiece::Kind::kKey};
    } else if (!ParseInt(word, &group)) {
      Fail(line, name + " has an unknown placeholder '{" + word + "}'; " +
                     Hint("{" + word + "}", Placeholders(rule)));
    } else if (group < 1) {
      Fail(line, name + ": {" + word + "} is not a capture group, they count from 1; {key} is the whole key");
    } else if (const int groups = rule.key_regex->NumberOfCapturingGroups(); group > groups) {
      Fail(line, name + " uses {" + word + "} but key '" + rule.key_pattern + "' has " +
                     std::to_string(groups) + " capture group" + (groups == 1 ? "" : "s") +
                     "; put the part to copy in parentheses or use a lower number");
    } else {
      return NamePiece{NamePiece::Kind::kGroup, "", static_cast<int>(group)};
    }
    return std::nullopt;
  }

  // The placeholders a name of `rule` may use.
  static std::vector<std::string> Placeholders(const ParamRule& rule) {
    std::vector<std::string> out;
    if (rule.role == "block") out.push_back("{block}");
    out.insert(out.end(), {"{layer}", "{key}"});
    for (int i = 1; i <= rule.key_regex->NumberOfCapturingGroups(); ++i) {
      out.push_back("{" + std::to_string(i) + "}");
    }
    return out;
  }

  static bool NameUses(const ParamRule& rule, NamePiece::Kind kind) {
    return std::any_of(rule.name_pieces.begin(), rule.name_pieces.end(),
                       [&](const NamePiece& p) { return p.kind == kind; });
  }

  void ParseFlag(const Fields& fields, const std::string& name, bool* out) {
    if (const Field* f = Get(fields, name)) {
      if (auto b = ReadBool(*f, name)) *out = *b;
    }
  }

  void ParseSplit(const Field& f, ParamRule* rule) {
    if (f.node.IsScalar()) {
      ParseSplitName(f, rule);
      return;
    }
    auto fields = ReadFields(f, "split", kSplitFields);
    if (!fields) return;
    rule->policy = ParamRule::Policy::kSplit;
    bool vocab = false;
    if (const Field* v = Get(*fields, "vocab")) vocab = ReadBool(*v, "split.vocab").value_or(false);
    if (const Field* d = Get(*fields, "dim")) {
      std::optional<int64_t> dim = ReadInt(*d, "split.dim");
      if (dim && *dim < 0) {
        Fail(*d, "split dim " + std::to_string(*dim) +
                     " is negative; use 0 (rows, column-parallel) or 1 (columns, row-parallel)");
      } else if (dim) {
        rule->dim = static_cast<int>(*dim);
      }
    } else if (!vocab) {
      Fail(f, "split needs dim: 0 (rows, column-parallel) or 1 (columns, row-parallel)");
    }
    if (const Field* p = Get(*fields, "parts")) {
      std::optional<int64_t> parts = ReadInt(*p, "split.parts");
      if (parts && *parts < 1) {
        Fail(*p, "split parts " + std::to_string(*parts) + " must be at least 1 (sub-parameters per shard)");
      } else if (parts) {
        rule->parts = static_cast<int>(*parts);
      }
    }
    if (const Field* b = Get(*fields, "blocks")) rule->blocks = ReadMetaRef(*b, "split.blocks");
    if (vocab) CheckVocabSplit(f, rule);
  }

  void ParseSplitName(const Field& f, ParamRule* rule) {
    const std::string& name = f.node.Scalar();
    rule->policy = ParamRule::Policy::kSplit;
    if (name == "column") {
      rule->dim = 0;
    } else if (name == "row") {
      rule->dim = 1;
    } else if (name == "vocab") {
      rule->policy = ParamRule::Policy::kVocab;
    } else {
      Fail(f,
           "unknown split '" + name + "'; " + Hint(name, kSplitNames) + " (or a map {dim, parts, blocks})");
    }
  }

  // Vocab padding is added and removed as whole rows at the tail.
  void CheckVocabSplit(const Field& f, ParamRule* rule) {
    rule->policy = ParamRule::Policy::kVocab;
    if (rule->dim != 0) {
      Fail(f, "split: vocab must be on dim 0 (vocabulary rows), not dim " + std::to_string(rule->dim));
    }
    if (rule->parts != 1 || !rule->blocks.empty()) {
      Fail(f, "split: vocab takes no parts or blocks; remove them");
    }
  }

  void ParseReplicated(const Field& f, ParamRule* rule) {
    rule->policy = ParamRule::Policy::kReplicated;
    if (f.node.IsScalar()) {
      std::optional<bool> b = ReadBool(f, "replicated");
      if (b && !*b) Fail(f, "replicated: false is not a policy; use replicated: true or a split");
      return;
    }
    auto fields = ReadFields(f, "replicated", kReplicatedFields);
    if (!fields) return;
    if (const Field* d = Get(*fields, "drift")) {
      auto name = ReadString(*d, "replicated.drift");
      if (!name) return;
      rule->drift = ParseDriftPolicy(*name);
      if (!rule->drift) {
        Fail(*d, "unknown drift policy '" + *name + "'; use check, average or first");
      }
    }
  }

  // ---- the hf section: the HF transformers export ----

  void ParseHf(const Field& f) {
    auto fields = ReadFields(f, "hf", kHfFields);
    if (!fields) return;
    HfExport hf;
    hf.line = f.line;
    if (const Field* a = Get(*fields, "architecture")) {
      auto name = ReadString(*a, "hf.architecture");
      if (name && !IsIdentifier(*name)) {
        Fail(*a, "hf.architecture '" + *name + "' must be a transformers class name, e.g. LlamaForCausalLM");
      } else if (name) {
        hf.architecture = *name;
      }
    } else {
      Fail(f, "missing hf.architecture; add the transformers class, e.g. architecture: LlamaForCausalLM");
    }
    if (const Field* r = Get(*fields, "requires")) hf.requirements = ReadArgConditions(*r, "hf.requires");
    if (const Field* c = Get(*fields, "config")) hf.config = ParseHfConfig(*c);
    if (const Field* t = Get(*fields, "tensors")) {
      hf.tensors = ParseHfTensors(*t);
    } else {
      Fail(f, "missing hf.tensors; map every canonical tensor to its HF name ({from: ..., to: ...})");
    }
    if (const Field* p = Get(*fields, "base_model_prefix")) {
      auto prefix = ReadString(*p, "hf.base_model_prefix");
      if (prefix && !IsIdentifier(*prefix)) {
        Fail(*p, "hf.base_model_prefix '" + *prefix + "' must be the base model's attribute name, e.g. transformer");
      } else if (prefix) {
        hf.base_model_prefix = *prefix;
      }
    }
    if (const Field* i = Get(*fields, "ignore")) hf.ignore = ReadStringList(*i, "hf.ignore");
    if (const Field* t = Get(*fields, "tied")) ParseHfTied(*t, &hf);
    rs_->hf_ = std::move(hf);
  }

  void ParseHfTied(const Field& f, HfExport* hf) {
    if (!f.node.IsMap()) {
      Fail(f, "hf.tied must be a mapping of HF name -> the HF name it is tied to, e.g. {lm_head.weight: transformer.wte.weight}");
      return;
    }
    for (const auto& kv : f.node) {
      const Field value{kv.second, LineOf(kv.first, f.line)};
      auto to = ReadString(value, "hf.tied value");
      if (to && kv.first.IsScalar()) hf->tied.emplace_back(kv.first.Scalar(), *to);
    }
  }

  std::vector<HfConfigField> ParseHfConfig(const Field& f) {
    std::vector<HfConfigField> out;
    if (!f.node.IsMap()) {
      Fail(f, "hf.config must be a mapping of config.json key -> value, metadata path or list of cases");
      return out;
    }
    std::map<std::string, int> lines;
    for (const auto& kv : f.node) {
      HfConfigField field;
      field.key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      field.line = LineOf(kv.first, f.line);
      const Field value{kv.second, field.line};
      if (!IsIdentifier(field.key)) {
        Fail(value, "hf.config key '" + field.key + "' must be a config.json field name");
        continue;
      }
      if (std::find(kHfDerivedKeys.begin(), kHfDerivedKeys.end(), field.key) != kHfDerivedKeys.end()) {
        Fail(value, "hf.config." + field.key + " is written by reshard from the checkpoint's tensors; remove it");
        continue;
      }
      if (!lines.emplace(field.key, field.line).second) {
        Fail(value, "hf.config." + field.key + " appears twice (first at line " +
                        std::to_string(lines[field.key]) + "); keep one");
        continue;
      }
      const bool cases = value.node.IsSequence() && value.node.size() > 0 && value.node[0].IsMap();
      const bool explained = value.node.IsMap();
      const bool ok = cases ? ParseHfCases(value, &field) : explained ? ParseExplained(value, &field)
                                                                      : ParseHfValue(value, &field);
      if (ok) out.push_back(std::move(field));
    }
    return out;
  }

  // A literal, a metadata path (a dotted name), or a list of paths that may
  // end with a literal fallback.
  bool ParseHfValue(const Field& f, HfConfigField* field) {
    const std::string what = "hf.config." + field->key;
    std::vector<Field> items = f.node.IsSequence() ? Items(f) : std::vector<Field>{f};
    if (items.empty()) Fail(f, what + " is an empty list; give a value or a metadata path");
    for (const Field& item : items) {
      if (item.node.IsMap()) {
        if (!ParseNullMeans(item, field)) return false;
        continue;
      }
      if (!field->null_means.empty()) {
        Fail(item, what + ": {null_means: ...} ends the list; move it last");
        return false;
      }
      if (item.node.IsNull() && !field->literal) {
        field->literal = std::make_shared<const Value>(Value::None());
        continue;
      }
      if (!item.node.IsScalar()) {
        Fail(item, what + " must be a value, a metadata path like args.hidden_size, a list of those, "
                          "or a list of cases {when: {...}, value: ...}");
        return false;
      }
      if (field->literal) {
        Fail(item, what + ": '" + item.node.Scalar() + "' follows a literal value; a literal is the "
                          "fallback, so it goes last");
        return false;
      }
      const bool quoted = item.node.Tag() == "!";
      if (!quoted && item.node.Scalar().find('.') != std::string::npos && IsDottedPath(item.node.Scalar())) {
        field->paths.push_back(item.node.Scalar());
      } else {
        field->literal = std::make_shared<const Value>(HfLiteral(item.node));
      }
    }
    return true;
  }

  // {value: LITERAL, why_not: TEXT}: a literal the architecture needs, and
  // why another value is refused.
  bool ParseExplained(const Field& f, HfConfigField* field) {
    auto fields = ReadFields(f, "hf.config." + field->key, kHfExplainedFields);
    if (!fields) return false;
    const Field* value = Get(*fields, "value");
    const Field* why_not = Get(*fields, "why_not");
    if (value == nullptr || !(value->node.IsScalar() || value->node.IsNull()) || why_not == nullptr ||
        !why_not->node.IsScalar()) {
      Fail(f, "hf.config." + field->key + ": a mapping must be {value: LITERAL, why_not: TEXT}");
      return false;
    }
    field->literal = std::make_shared<const Value>(value->node.IsNull() ? Value::None() : HfLiteral(value->node));
    field->why_not = why_not->node.Scalar();
    return true;
  }

  // {null_means: SIZE} after a field's paths: the size config.json's null
  // stands for (N, a path, or N*path).
  bool ParseNullMeans(const Field& item, HfConfigField* field) {
    const std::string what = "hf.config." + field->key;
    const YAML::Node size = item.node["null_means"];
    if (item.node.size() != 1 || !size || !size.IsScalar() || field->paths.empty() || field->literal) {
      Fail(item, what + ": a mapping in the list must be {null_means: N, path or N*path}, after the metadata "
                        "paths and without a literal fallback");
      return false;
    }
    field->null_means = size.Scalar();
    return true;
  }

  bool ParseHfCases(const Field& f, HfConfigField* field) {
    const std::string what = "hf.config." + field->key;
    for (const Field& item : Items(f)) {
      auto fields = ReadFields(item, "a case of " + what, kHfCaseFields);
      if (!fields) return false;
      const Field* when = Get(*fields, "when");
      const Field* value = Get(*fields, "value");
      const Field* why_not = Get(*fields, "why_not");
      if (when == nullptr || value == nullptr || value->node.IsSequence() ||
          (why_not != nullptr && !why_not->node.IsScalar())) {
        Fail(item, "a case of " + what + " needs when: {args field: value}, a value (a literal, null or a "
                   "mapping) and optionally why_not: TEXT");
        return false;
      }
      HfConfigField::Case c{ReadArgConditions(*when, what + " when"), nullptr, {}, ""};
      if (why_not != nullptr) c.why_not = why_not->node.Scalar();
      if (value->node.IsMap()) {
        if (!ParseCaseEntries(*value, what, &c.entries)) return false;
      } else {
        c.value = std::make_shared<const Value>(value->node.IsNull() ? Value::None() : HfLiteral(value->node));
      }
      field->cases.push_back(std::move(c));
    }
    return true;
  }

  // A case's mapping (rope_scaling): each entry a literal, a metadata path
  // or a list of paths ending with a literal fallback, as a field's value.
  bool ParseCaseEntries(const Field& f, const std::string& what, std::vector<HfConfigField>* entries) {
    for (const auto& kv : f.node) {
      HfConfigField entry;
      entry.key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      entry.line = LineOf(kv.first, f.line);
      const Field value{kv.second, entry.line};
      if (!IsIdentifier(entry.key) || value.node.IsMap()) {
        Fail(value, "an entry of a case of " + what + " must be key: a value, a metadata path or a list of "
                    "paths ending with a literal");
        return false;
      }
      if (!ParseHfValue(value, &entry)) return false;
      entries->push_back(std::move(entry));
    }
    return true;
  }

  // A YAML scalar as the value it stands for; always a string when quoted.
  static Value HfLiteral(const YAML::Node& n) {
    return n.Tag() == "!" ? Value::String(n.Scalar()) : ScalarValue(n.Scalar());
  }

  std::vector<HfTensorMap> ParseHfTensors(const Field& f) {
    std::vector<HfTensorMap> out;
    if (!f.node.IsSequence() || f.node.size() == 0) {
      Fail(f, "hf.tensors must be a non-empty list of {from: <canonical name>, to: <HF name or names>}");
      return out;
    }
    std::map<std::string, int> froms, tos;
    for (const Field& item : Items(f)) {
      std::optional<HfTensorMap> map = ParseHfTensor(item);
      if (!map) continue;
      if (!froms.emplace(map->from, item.line).second) {
        Fail(item, "hf.tensors maps '" + map->from + "' twice (first at line " +
                       std::to_string(froms[map->from]) + "); keep one");
        continue;
      }
      for (const std::string& to : map->to) {
        if (!tos.emplace(to, item.line).second) {
          Fail(item, "hf.tensors writes '" + to + "' twice (first at line " + std::to_string(tos[to]) +
                         "); give each tensor its own name");
        }
      }
      out.push_back(std::move(*map));
    }
    return out;
  }

  std::optional<HfTensorMap> ParseHfTensor(const Field& f) {
    const size_t errors_before = errors_.size();
    auto fields = ReadFields(f, "an hf.tensors entry", kHfTensorFields);
    if (!fields) return std::nullopt;
    HfTensorMap map;
    map.line = f.line;
    const Field* from = Get(*fields, "from");
    const Field* to = Get(*fields, "to");
    if (from == nullptr || to == nullptr) {
      Fail(f, "an hf.tensors entry needs from: <canonical name> and to: <HF name or list of names>");
      return std::nullopt;
    }
    if (auto s = ReadString(*from, "hf.tensors from")) map.from = *s;
    map.to = to->node.IsSequence() ? ReadStringList(*to, "hf.tensors to") : std::vector<std::string>{};
    if (!to->node.IsSequence()) {
      if (auto s = ReadString(*to, "hf.tensors to")) map.to.push_back(*s);
    }
    const bool blocks = CheckHfTemplate(*from, map.from);
    for (const std::string& name : map.to) {
      if (CheckHfTemplate(*to, name) != blocks) {
        Fail(*to, "'" + name + "' and '" + map.from + "' must both use {block} or neither; one tensor per "
                      "block maps to one per block");
      }
    }
    ParseFlag(*fields, "transpose", &map.transpose);
    if (const Field* shape = Get(*fields, "shape")) map.shape = ReadShape(*shape, "hf.tensors shape");
    ParseHfSplit(*fields, &map);
    if (errors_.size() != errors_before) return std::nullopt;
    return map;
  }

  // ---- the torch_dist section: reading the family from Megatron-Core ----------

  void ParseTorchDist(const Field& f) {
    auto fields = ReadFields(f, "torch_dist", kTorchDistFields);
    if (!fields) return;
    TorchDistLayout layout;
    layout.line = f.line;
    if (const Field* a = Get(*fields, "args")) layout.args = ParseTorchDistArgs(*a);
    if (const Field* e = Get(*fields, "extra_state")) layout.extra_state = ReadStringList(*e, "torch_dist.extra_state");
    if (const Field* e = Get(*fields, "expert_extra_state")) {
      layout.expert_extra_state = ReadStringList(*e, "torch_dist.expert_extra_state");
    }
    if (const Field* e = Get(*fields, "torch_extra_state")) {
      layout.torch_extra_state = ReadStringList(*e, "torch_dist.torch_extra_state");
    }
    if (const Field* e = Get(*fields, "te_extra_state")) layout.te_extra_state = ReadStringList(*e, "torch_dist.te_extra_state");
    if (const Field* h = Get(*fields, "tied_head")) layout.tied_head = ReadString(*h, "torch_dist.tied_head").value_or("");
    const Field* t = Get(*fields, "tensors");
    if (t == nullptr || !t->node.IsSequence() || t->node.size() == 0) {
      Fail(t ? *t : f, "torch_dist.tensors must be a non-empty list of {name: <canonical name>, key: <torch_dist key "
                       "or list of alternatives>}");
      return;
    }
    std::map<std::string, int> names;
    for (const Field& item : Items(*t)) {
      std::optional<TorchDistTensor> tensor = ParseTorchDistTensor(item);
      if (!tensor) continue;
      if (!names.emplace(tensor->name, item.line).second) {
        Fail(item, "torch_dist.tensors maps '" + tensor->name + "' twice (first at line " +
                       std::to_string(names[tensor->name]) + "); keep one");
        continue;
      }
      layout.tensors.push_back(std::move(*tensor));
    }
    if (const Field* order = Get(*fields, "optimizer_order")) {
      layout.optimizer_order = ParseOptimizerOrder(*order, layout.tensors);
    }
    rs_->torch_dist_ = std::move(layout);
  }

  // ---- the torchtitan section: the HF model under torchtitan's keys -----------

  void ParseTorchtitan(const Field& f) {
    auto fields = ReadFields(f, "torchtitan", kTorchtitanFields);
    if (!fields) return;
    if (!rs_->hf_) {
      Fail(f, "torchtitan maps the tensors of the hf section, which this file lacks; add an hf section");
      return;
    }
    TorchtitanLayout layout;
    layout.line = f.line;
    if (const Field* c = Get(*fields, "config")) layout.config = ParseTorchtitanConfig(*c);
    if (const Field* i = Get(*fields, "ignore")) layout.ignore = ReadStringList(*i, "torchtitan.ignore");
    const Field* t = Get(*fields, "tensors");
    if (t == nullptr || !t->node.IsSequence() || t->node.size() == 0) {
      Fail(t ? *t : f, "torchtitan.tensors must be a non-empty list of {hf: <hf tensor name>, key: <torchtitan key or "
                       "list of alternatives>}");
      return;
    }
    for (const Field& item : Items(*t)) {
      if (std::optional<TorchtitanTensor> tensor = ParseTorchtitanTensor(item)) layout.tensors.push_back(std::move(*tensor));
    }
    rs_->torchtitan_ = std::move(layout);
  }

  // config.json key -> a number (a literal) or a size expression.
  std::vector<std::pair<std::string, std::string>> ParseTorchtitanConfig(const Field& f) {
    std::vector<std::pair<std::string, std::string>> out;
    if (!f.node.IsMap()) {
      Fail(f, "torchtitan.config must be a mapping of config.json key -> number or size (e.g. tok_embeddings.weight[1])");
      return out;
    }
    for (const auto& kv : f.node) {
      const Field value{kv.second, LineOf(kv.first, f.line)};
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      auto text = ReadString(value, "torchtitan.config." + key);
      if (!text) continue;
      if (!IsNumber(*text)) CheckSize(value, *text);
      out.emplace_back(key, *text);
    }
    return out;
  }

  static bool IsNumber(const std::string& text) {
    char* end = nullptr;
    std::strtod(text.c_str(), &end);
    return !text.empty() && *end == '\0';
  }

  void CheckSize(const Field& f, const std::string& text) {
    Result<SizeExpression> e = ParseSizeExpression(text);
    if (!e.ok()) Fail(f, e.status().message());
  }

  std::optional<TorchtitanTensor> ParseTorchtitanTensor(const Field& f) {
    const size_t errors_before = errors_.size();
    auto fields = ReadFields(f, "a torchtitan.tensors entry", kTorchtitanTensorFields);
    if (!fields) return std::nullopt;
    TorchtitanTensor t;
    t.line = f.line;
    const Field* hf = Get(*fields, "hf");
    const Field* key = Get(*fields, "key");
    if (hf == nullptr || key == nullptr) {
      Fail(f, "a torchtitan.tensors entry needs hf: <hf tensor name> and key: <torchtitan key or list of alternatives>");
      return std::nullopt;
    }
    t.hf = ReadString(*hf, "torchtitan.tensors hf").value_or("");
    const bool block = CheckHfTemplate(*hf, t.hf);
    t.keys = key->node.IsSequence() ? ReadStringList(*key, "torchtitan.tensors key")
                                    : std::vector<std::string>{ReadString(*key, "torchtitan.tensors key").value_or("")};
    for (const std::string& k : t.keys) {
      if (CheckHfTemplate(*key, k) != block) {
        Fail(*key, "torchtitan key '" + k + "' and hf name '" + t.hf + "' must both have {block} or neither");
      }
    }
    if (const Field* heads = Get(*fields, "interleaved_heads")) {
      t.interleaved_heads = ReadString(*heads, "torchtitan.tensors interleaved_heads").value_or("");
      CheckSize(*heads, t.interleaved_heads);
    }
    if (const Field* tp = Get(*fields, "tp")) ParseTorchtitanTp(*tp, &t);
    if (errors_.size() != errors_before) return std::nullopt;
    return t;
  }

  // `tp: {dim: D, blocks: SIZE}`: the tensor is Shard(D) on the TP mesh.
  void ParseTorchtitanTp(const Field& f, TorchtitanTensor* t) {
    auto fields = ReadFields(f, "torchtitan.tensors tp", kTorchtitanTpFields);
    if (!fields) return;
    const Field* d = Get(*fields, "dim");
    std::optional<int64_t> dim = d ? ReadInt(*d, "torchtitan.tensors tp.dim") : std::nullopt;
    if (d == nullptr || (dim && (*dim < 0 || *dim > 1))) {
      Fail(d ? *d : f, "torchtitan.tensors tp needs dim: 0 (rows: ColwiseParallel, an Embedding) or 1 (columns: "
                       "RowwiseParallel); leave tp out for a tensor replicated on the TP mesh");
      return;
    }
    if (dim) t->tp_dim = static_cast<int>(*dim);
    if (const Field* b = Get(*fields, "blocks")) {
      t->tp_blocks = ReadString(*b, "torchtitan.tensors tp.blocks").value_or("");
      CheckSize(*b, t->tp_blocks);
    }
  }

  // The keys of `tensors` in registration order: each a key of one entry,
  // once; the block keys in one run; every entry placed.
  std::vector<std::string> ParseOptimizerOrder(const Field& f, const std::vector<TorchDistTensor>& tensors) {
    const std::string what = "torch_dist.optimizer_order";
    std::vector<std::string> order = ReadStringList(f, what);
    if (f.node.IsSequence() && order.empty()) Fail(f, what + " is an empty list; list the model's keys in registration order");
    std::map<std::string, const TorchDistTensor*> entry_of;
    for (const TorchDistTensor& t : tensors) {
      for (const std::string& key : t.keys) entry_of[key] = &t;
    }
    std::set<std::string> seen;
    std::set<const TorchDistTensor*> placed;
    int block_runs = 0;
    bool in_blocks = false;
    for (const std::string& key : order) {
      auto it = entry_of.find(key);
      if (it == entry_of.end()) {
        Fail(f, what + " names '" + key + "', which no torch_dist.tensors entry has as its key; list the section's keys only");
        continue;
      }
      if (!seen.insert(key).second) Fail(f, what + " lists '" + key + "' twice; keep its first place");
      placed.insert(it->second);
      const bool block = it->second->name.find("{block}") != std::string::npos;
      block_runs += block && !in_blocks;
      in_blocks = block;
    }
    if (block_runs > 1) {
      Fail(f, what + " interleaves the block keys with others; list one layer's keys together (they repeat for "
              "every layer, between the first stage's keys and the last stage's)");
    }
    for (const TorchDistTensor& t : tensors) {
      if (!order.empty() && !placed.count(&t)) {
        Fail(f, what + " gives no place to '" + t.name + "' (line " + std::to_string(t.line) + "); add its key " +
                    t.keys[0] + " where the model registers it");
      }
    }
    return order;
  }

  // args field -> a metadata path, or {from: path | value: scalar, when: {...}}.
  std::vector<TorchDistArg> ParseTorchDistArgs(const Field& f) {
    std::vector<TorchDistArg> out;
    if (!f.node.IsMap()) {
      Fail(f, "torch_dist.args must be a mapping of args field -> metadata path or {from: path, when: {...}}");
      return out;
    }
    for (const auto& kv : f.node) {
      Field value{kv.second, LineOf(kv.first, f.line)};
      TorchDistArg arg;
      arg.line = value.line;
      arg.set = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      const std::string what = "torch_dist.args." + arg.set;
      if (!IsIdentifier(arg.set)) {
        Fail(value, "torch_dist.args key '" + arg.set + "' must be an args field name");
        continue;
      }
      if (value.node.IsScalar()) {
        arg.from = value.node.Scalar();
      } else if (auto fields = ReadFields(value, what, kTorchDistArgFields)) {
        const Field* from = Get(*fields, "from");
        const Field* literal = Get(*fields, "value");
        if ((from == nullptr) == (literal == nullptr)) {
          Fail(value, what + " needs one of from: <metadata path> and value: <scalar>");
          continue;
        }
        if (from) arg.from = ReadString(*from, what + ".from").value_or("");
        if (literal) arg.value = std::make_shared<const Value>(HfLiteral(literal->node));
        if (const Field* when = Get(*fields, "when")) arg.when = ReadArgConditions(*when, what + ".when");
      }
      if (arg.value == nullptr && arg.from.find('.') == std::string::npos) {
        Fail(value, what + " must name a metadata path, e.g. args.num_query_groups");
        continue;
      }
      out.push_back(std::move(arg));
    }
    return out;
  }

  std::optional<TorchDistTensor> ParseTorchDistTensor(const Field& f) {
    const size_t errors_before = errors_.size();
    auto fields = ReadFields(f, "a torch_dist.tensors entry", kTorchDistTensorFields);
    if (!fields) return std::nullopt;
    TorchDistTensor t;
    t.line = f.line;
    const Field* name = Get(*fields, "name");
    const Field* key = Get(*fields, "key");
    if (name == nullptr || key == nullptr) {
      Fail(f, "a torch_dist.tensors entry needs name: <canonical name> and key: <torch_dist key or list of "
              "alternatives>");
      return std::nullopt;
    }
    if (auto s = ReadString(*name, "torch_dist.tensors name")) t.name = *s;
    CheckTorchDistTemplate(*name, t.name);
    if (key->node.IsSequence()) {
      t.keys = ReadStringList(*key, "torch_dist.tensors key");
    } else if (auto s = ReadString(*key, "torch_dist.tensors key")) {
      t.keys.push_back(*s);
    }
    if (const Field* local = Get(*fields, "local")) {
      t.local_key = ReadString(*local, "torch_dist.tensors local").value_or("");
      // A torch_dist save of another version may name it so too.
      if (std::find(t.keys.begin(), t.keys.end(), t.local_key) == t.keys.end()) t.keys.push_back(t.local_key);
    }
    for (const std::string& k : t.keys) {
      if (k.find('{') != std::string::npos) {
        Fail(*key, "torch_dist key '" + k + "' has a placeholder; Megatron-Core stacks the blocks of one key on "
                   "its first axis, so the key names them all");
      }
    }
    if (const Field* shape = Get(*fields, "shape")) t.shape = ReadShape(*shape, "torch_dist.tensors shape");
    if (errors_.size() != errors_before) return std::nullopt;
    return t;
  }

  // A list of dims, each an integer, a metadata path, N*path or * (any).
  std::vector<std::string> ReadShape(const Field& f, const std::string& what) {
    static const RE2 re("([0-9]+\\*)?[A-Za-z_][A-Za-z0-9_]*(\\.[A-Za-z_][A-Za-z0-9_]*)+|[0-9]+|\\*");
    std::vector<std::string> dims = ReadStringList(f, what);
    for (const std::string& dim : dims) {
      if (!RE2::FullMatch(dim, re)) {
        Fail(f, what + " dim '" + dim + "' must be an integer, a metadata path, N*path or * (any "
                "size), e.g. 4*args.hidden_size");
      }
    }
    return dims;
  }

  // Checks a torch_dist name template: {block}, and {expert} after it (the
  // key stacks the experts on the axis after the layer axis).
  void CheckTorchDistTemplate(const Field& f, const std::string& name) {
    static const RE2 re("([^{}]|\\{block\\}|\\{expert\\})+");
    const size_t block = name.find("{block}"), expert = name.find("{expert}");
    if (!RE2::FullMatch(name, re)) {
      Fail(f, "torch_dist tensor name '" + name + "': the placeholders are {block} (the 0-based block) and "
              "{expert} (the 0-based global expert)");
    } else if (expert != std::string::npos && (block == std::string::npos || block > expert ||
                                                name.find("{expert}", expert + 1) != std::string::npos)) {
      Fail(f, "torch_dist tensor name '" + name + "' has {expert} without {block} before it; Megatron-Core stacks "
              "a MoE layer's experts on the axis after the layer axis");
    }
  }

  // Checks a name template (only {block}); returns whether it uses {block}.
  bool CheckHfTemplate(const Field& f, const std::string& name) {
    static const RE2 re("([^{}]|\\{block\\})+");
    if (!RE2::FullMatch(name, re)) {
      Fail(f, "hf tensor name '" + name + "': the only placeholder is {block} (the 0-based block)");
    }
    return name.find("{block}") != std::string::npos;
  }

  void ParseHfSplit(const Fields& fields, HfTensorMap* map) {
    const Field* halves = Get(fields, "split_halves");
    const Field* qkv = Get(fields, "split_qkv");
    const Field& where = halves ? *halves : qkv ? *qkv : *Get(fields, "to");
    if (halves && qkv) {
      Fail(where, "an hf.tensors entry has split_halves and split_qkv; keep one");
      return;
    }
    if (halves && ReadBool(*halves, "split_halves").value_or(false)) map->split = HfTensorMap::Split::kHalves;
    if (qkv) {
      map->split = HfTensorMap::Split::kQkv;
      auto sizes = ReadFields(*qkv, "split_qkv", kHfQkvFields);
      const Field* groups = sizes ? Get(*sizes, "groups") : nullptr;
      const Field* heads = sizes ? Get(*sizes, "heads") : nullptr;
      if (groups == nullptr || heads == nullptr) {
        Fail(*qkv, "split_qkv needs groups (KV heads) and heads (attention heads), sizes like "
                   "args.num_attention_heads");
        return;
      }
      map->groups = ReadMetaRef(*groups, "split_qkv.groups");
      map->heads = ReadMetaRef(*heads, "split_qkv.heads");
    }
    const size_t n = map->to.size();
    if (map->split == HfTensorMap::Split::kHalves && n != 2) {
      Fail(where, "split_halves writes two tensors, the first half and the second; list two names in to");
    } else if (map->split == HfTensorMap::Split::kQkv && n != 1 && n != 3) {
      Fail(where, "split_qkv writes q, k and v (three names in to) or one tensor [q; k; v] (one name)");
    } else if (map->split == HfTensorMap::Split::kNone && n != 1) {
      Fail(where, "to lists " + std::to_string(n) + " names; dividing a tensor needs split_halves or split_qkv");
    }
  }

  // ---- checks across sections ----

  void CheckConsistency() {
    CheckLayerRoles();
    CheckModulePathRoles();
    CheckTies();
    CheckVocab();
    CheckFixedNames();
  }

  // Every role that owns files needs rules, and every set of rules a role that owns files.
  void CheckLayerRoles() {
    for (const auto& [role, line] : layer_role_lines_) {
      if (owning_role_lines_.count(role)) continue;
      if (other_role_lines_.count(role)) {
        Fail(line, "layers." + role + ": spec role '" + role +
                       "' owns no layer file, so it takes no rules; remove it");
      } else {
        Fail(line, "layers." + role + ": role '" + role + "' is in no pipeline spec list; add {" + role +
                       ": ClassName} to pipeline.specs or fix the name");
      }
    }
    for (const auto& [role, line] : owning_role_lines_) {
      if (layer_role_lines_.count(role)) continue;
      Fail(line, "spec role '" + role + "' owns layer files but layers has no '" + role +
                     "' entry; add layers." + role + " (or use role function for a parameter-free entry)");
    }
  }

  // A module path names a role with rules.
  void CheckModulePathRoles() {
    for (const ModulePath& m : rs_->module_paths_) {
      if (!layer_role_lines_.count(m.role)) {
        Fail(m.line, "module_paths." + m.role + ": no layers." + m.role + " rules describe its tensors; "
                     "fix the role name or add the rules");
      }
    }
  }

  void CheckTies() {
    bool has_tied_head = other_role_lines_.count("tied_head") > 0;
    if (has_tied_head && rs_->tied_module_.empty()) {
      Fail(other_role_lines_["tied_head"],
           "a tied_head spec needs pipeline.tied_module (the TiedLayerSpec key, e.g. embed)");
    }
    if (!has_tied_head && !rs_->tied_module_.empty()) {
      Fail(tied_module_line_,
           "pipeline.tied_module is set but no spec list has a tied_head entry; remove one or add the other");
    }
    for (const auto& [role, rules] : rs_->layers_) {
      for (const ParamRule& rule : rules) {
        if (rule.tied && !has_tied_head) {
          Fail(rule.line, "rule '" + rule.key_pattern + "' is tied but no spec list has a tied_head entry");
        }
      }
    }
  }

  // Re-padding the vocabulary for a new TP needs the true size and the multiple.
  void CheckVocab() {
    for (const auto& [role, rules] : rs_->layers_) {
      for (const ParamRule& rule : rules) {
        if (rule.policy != ParamRule::Policy::kVocab) continue;
        if (rs_->vocab_original_size_.empty() || rs_->vocab_divisible_by_.empty()) {
          Fail(rule.line, "rule '" + rule.key_pattern +
                              "' splits the vocabulary; set vocab.original_size and vocab.divisible_by");
          return;
        }
      }
    }
  }

  // A name without {key} or a group is the same for every key its rule
  // matches. Two such rules with one template name two tensors alike: in the
  // same file (one role), or in any two files when the name has no {layer}.
  // Names built from keys can only be checked against the keys, by callers.
  void CheckFixedNames() {
    std::map<std::pair<std::string, std::string>, const ParamRule*> seen;  // (scope, template)
    for (const auto& [role, rules] : rs_->layers_) {
      for (const ParamRule& rule : rules) {
        if (NameUses(rule, NamePiece::Kind::kKey) || NameUses(rule, NamePiece::Kind::kGroup)) continue;
        std::string scope = NameUses(rule, NamePiece::Kind::kLayer) ? role : "";
        auto [it, inserted] = seen.emplace(std::make_pair(scope, rule.name_template), &rule);
        if (inserted) continue;
        const int first = std::min(it->second->line, rule.line);
        const int second = std::max(it->second->line, rule.line);
        Fail(second, "rules at lines " + std::to_string(first) + " and " + std::to_string(second) +
                         " both name their tensors '" + rule.name_template +
                         "'; give each its own name or add {key}");
      }
    }
  }

  std::string origin_;
  RuleSet* rs_;
  std::vector<std::string> errors_;
  std::map<std::string, int> owning_role_lines_;  // spec roles that own files -> first line
  std::map<std::string, int> other_role_lines_;   // function, tied_head -> first line
  std::map<std::string, int> layer_role_lines_;   // layers.<role> -> line
  int tied_module_line_ = 0;
};

// ---- RuleSet -----------------------------------------------------------------

Result<RuleSet> RuleSet::LoadFile(const std::string& path) {
  Result<std::string> text = ReadRegularFile(path);
  if (!text.ok()) return Status::InvalidInput("cannot read rule file '" + path + "': " + text.status().message());
  return LoadString(*text, path);
}

Result<RuleSet> RuleSet::LoadString(const std::string& yaml, const std::string& origin) {
  RuleSet rs;
  rs.origin_ = origin;
  RESHARD_RETURN_IF_ERROR(RuleSetParser(origin, &rs).Parse(yaml));
  return rs;
}

}  // namespace reshard
