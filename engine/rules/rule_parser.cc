// Parsing and validation of rule files: RuleSet::LoadFile and LoadString.
//
// The parser reports every problem it finds, one line each ("file:line: what;
// fix"), rather than stopping at the first: a rule-file author fixes them in
// one pass. The format is documented in docs/rules.md.
#include "rules/rule_set.h"

#include <re2/re2.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>

#include "container/regular_file.h"
#include "rules/rule_reader.h"
#include "util/strings.h"

namespace reshard {
namespace {

// The core's fields; the formats' sections (RuleSectionParsers) follow.
const std::vector<std::string> kCoreFields = {"name",  "description",      "detect", "pipeline",
                                              "vocab", "optimizer_groups", "layers", "module_paths"};
const std::vector<std::string> kDetectFields = {"metadata_keys", "absent_metadata_keys", "args"};
const std::vector<std::string> kPipelineFields = {"specs", "partition_method", "tied_module", "requires"};
const std::vector<std::string> kPartitionFields = {"arg", "default"};
const std::vector<std::string> kVocabFields = {"original_size", "divisible_by", "pad_to"};
const std::vector<std::string> kRuleFields = {"key",      "name", "split", "replicated",
                                               "optional", "tied", "buffer", "moe", "expert"};
const std::vector<std::string> kSplitFields = {"dim", "parts", "blocks", "vocab"};
const std::vector<std::string> kReplicatedFields = {"drift"};
const std::vector<std::string> kSplitNames = {"column", "row", "vocab"};

// The fields of a rule file's top level: the core's, then every section's.
std::vector<std::string> TopFields() {
  std::vector<std::string> fields = kCoreFields;
  for (const RuleSectionParser& section : RuleSectionParsers()) fields.push_back(section.name);
  return fields;
}

}  // namespace

// ---- the parser --------------------------------------------------------------

class RuleSetParser : RuleReader {
 public:
  RuleSetParser(const std::string& origin, RuleSet* out) : RuleReader(origin, &errors_), rs_(out) {}

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
  // ---- sections ----

  void ParseTop(const Field& root) {
    auto fields = ReadFields(root, "the top level of a rule file", TopFields());
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
    for (const RuleSectionParser& section : RuleSectionParsers()) {
      const Field* f = Get(*fields, section.name);
      if (f == nullptr) continue;
      if (auto parsed = section.parse(*f, *rs_, this)) rs_->sections_[section.name] = std::move(parsed);
    }
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
    ReadFlag(*fields, "optional", &rule.optional);
    ReadFlag(*fields, "tied", &rule.tied);
    ReadFlag(*fields, "buffer", &rule.buffer);
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

  std::vector<std::string> errors_;  // what RuleReader reports
  RuleSet* rs_;
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
