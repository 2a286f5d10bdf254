#include "formats/hf_common/hf_rules.h"

#include <re2/re2.h>

#include <algorithm>
#include <map>

#include "pickle/value.h"

namespace reshard {
namespace {

const std::vector<std::string> kHfFields = {"architecture", "requires", "config", "tensors",
                                            "base_model_prefix", "ignore", "tied"};
const std::vector<std::string> kHfTensorFields = {"from", "to", "split_halves", "split_qkv", "transpose", "shape"};
const std::vector<std::string> kHfQkvFields = {"groups", "heads"};
const std::vector<std::string> kHfCaseFields = {"when", "value", "why_not"};
const std::vector<std::string> kHfExplainedFields = {"value", "why_not"};
// config.json keys the exporter writes itself, from the checkpoint's tensors.
const std::vector<std::string> kHfDerivedKeys = {"architectures", "vocab_size", "torch_dtype"};

class HfSectionParser : RuleReader {
 public:
  explicit HfSectionParser(const RuleReader& in) : RuleReader(in) {}

  std::shared_ptr<const RuleSection> Parse(const Field& f) {
    auto fields = ReadFields(f, "hf", kHfFields);
    if (!fields) return nullptr;
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
    return std::make_shared<const HfExport>(std::move(hf));
  }

 private:
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
        field->literal = std::make_shared<const Value>(Literal(item.node));
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
    field->literal = std::make_shared<const Value>(value->node.IsNull() ? Value::None() : Literal(value->node));
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
        c.value = std::make_shared<const Value>(value->node.IsNull() ? Value::None() : Literal(value->node));
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
    const size_t errors_before = error_count();
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
    const std::string placeholders = HfPlaceholders(*from, map.from, true, this);
    for (const std::string& name : map.to) {
      if (HfPlaceholders(*to, name, true, this) != placeholders) {
        Fail(*to, "'" + name + "' and '" + map.from + "' must use the same placeholders ({block}, {expert}); "
                      "one tensor per block (and expert) maps to one per block (and expert)");
      }
    }
    ReadFlag(*fields, "transpose", &map.transpose);
    if (const Field* shape = Get(*fields, "shape")) map.shape = ReadShape(*shape, "hf.tensors shape");
    ParseHfSplit(*fields, &map);
    if (error_count() != errors_before) return std::nullopt;
    return map;
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
};

}  // namespace

std::string HfPlaceholders(const Field& f, const std::string& name, bool experts, RuleReader* in) {
  static const RE2 with_experts("([^{}]|\\{block\\}|\\{expert\\})+");
  static const RE2 blocks_only("([^{}]|\\{block\\})+");
  if (!RE2::FullMatch(name, experts ? with_experts : blocks_only)) {
    in->Fail(f, "hf tensor name '" + name + "': the only placeholder" +
                    (experts ? "s are {block} (the 0-based block) and {expert} (the expert in its layer)"
                             : " is {block} (the 0-based block)"));
  }
  std::string placeholders;
  for (const char* p : {"{block}", "{expert}"}) {
    if (name.find(p) != std::string::npos) placeholders += p;
  }
  return placeholders;
}

std::shared_ptr<const RuleSection> ParseHfSection(const Field& section, const RuleSet& so_far, RuleReader* in) {
  return HfSectionParser(*in).Parse(section);
}

// What the HF export reads: its conditions, config fields and split sizes.
void HfExport::AddValuePaths(std::set<std::string>* paths) const {
  AddConditionPaths(requirements, paths);
  for (const HfConfigField& field : config) {
    paths->insert(field.paths.begin(), field.paths.end());
    for (const HfConfigField::Case& c : field.cases) {
      AddConditionPaths(c.when, paths);
      for (const HfConfigField& entry : c.entries) paths->insert(entry.paths.begin(), entry.paths.end());
    }
  }
  for (const HfTensorMap& map : tensors) {
    for (const MetaRef* ref : {&map.groups, &map.heads}) {
      for (std::string& p : ref->Paths()) paths->insert(std::move(p));
    }
    AddShapePaths(map.shape, paths);
  }
}

}  // namespace reshard
