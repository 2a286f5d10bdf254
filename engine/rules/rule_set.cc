// The rule model: drift policy names, metadata sizes, rule descriptions,
// canonical names and key matching. Parsing is in rule_parser.cc.
#include "rules/rule_set.h"

#include <re2/re2.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "pickle/value.h"
#include "util/strings.h"

namespace reshard {
namespace {

// The capture groups of `key`, which fully matches `re`; "" for a group that
// took no part in the match.
std::vector<std::string> CaptureGroups(const RE2& re, const std::string& key) {
  const int n = re.NumberOfCapturingGroups();
  std::vector<std::string> groups(n);
  std::vector<RE2::Arg> args;
  std::vector<const RE2::Arg*> arg_ptrs;
  args.reserve(n);
  for (std::string& group : groups) args.emplace_back(&group);
  for (const RE2::Arg& arg : args) arg_ptrs.push_back(&arg);
  RE2::FullMatchN(key, re, arg_ptrs.data(), n);
  return groups;
}

// Whether the canonical name of the tensor of `key` holds `placeholder`.
bool NameOfKeyHas(const std::vector<TorchDistTensor>& tensors, const std::string& key, const char* placeholder) {
  for (const TorchDistTensor& t : tensors) {
    if (std::find(t.keys.begin(), t.keys.end(), key) != t.keys.end() || t.local_key == key) {
      return t.name.find(placeholder) != std::string::npos;
    }
  }
  return false;
}

}  // namespace

bool TorchDistLayout::IsStackedKey(const std::string& key) const { return NameOfKeyHas(tensors, key, "{block}"); }

bool TorchDistLayout::IsExpertKey(const std::string& key) const { return NameOfKeyHas(tensors, key, "{expert}"); }

Value ScalarValue(const std::string& text) {
  int64_t n = 0;
  if (ParseInt(text, &n)) return Value::Int(n);
  if (text == "true" || text == "false") return Value::Bool(text == "true");
  char* end = nullptr;
  const double d = std::strtod(text.c_str(), &end);
  if (!text.empty() && end == text.c_str() + text.size()) return Value::Float(d);
  return Value::String(text);
}

const Value* WalkPath(const Value& root, const std::string& path) {
  const Value* v = &root;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    v = Find(*v, path.substr(start, dot == std::string::npos ? dot : dot - start));
    if (v == nullptr || v->is_none()) return nullptr;
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

const Value* RuleInputs::Find(const std::string& path) const {
  const Value* v = WalkPath(metadata, path);
  return v != nullptr ? v : WalkPath(settings, path);
}

const char* DriftPolicyName(DriftPolicy p) {
  switch (p) {
    case DriftPolicy::kCheck: return "check";
    case DriftPolicy::kAverage: return "average";
    case DriftPolicy::kFirst: return "first";
  }
  return "?";
}

std::optional<DriftPolicy> ParseDriftPolicy(const std::string& s) {
  for (DriftPolicy p : {DriftPolicy::kCheck, DriftPolicy::kAverage, DriftPolicy::kFirst}) {
    if (s == DriftPolicyName(p)) return p;
  }
  return std::nullopt;
}

std::optional<int64_t> MetaRef::Resolve(const RuleInputs& inputs) const {
  for (const std::string& alt : alternatives) {
    int64_t n = 0;
    if (ParseInt(alt, &n)) return n;
    const Value* v = inputs.Find(alt);
    if (v != nullptr && ReadInt(*v, &n)) return n;
  }
  return std::nullopt;
}

std::string MetaRef::ResolvedFrom(const RuleInputs& inputs) const {
  for (const std::string& alt : alternatives) {
    int64_t n = 0;
    if (ParseInt(alt, &n)) return alt;
    const Value* v = inputs.Find(alt);
    if (v != nullptr && ReadInt(*v, &n)) return alt;
  }
  return "";
}

const Value* MetaRef::Lookup(const RuleInputs& inputs) const {
  for (const std::string& path : Paths()) {
    if (const Value* v = inputs.Find(path)) return v;
  }
  return nullptr;
}

std::vector<std::string> MetaRef::Paths() const {
  std::vector<std::string> paths;
  for (const std::string& alt : alternatives) {
    int64_t unused = 0;
    if (!ParseInt(alt, &unused)) paths.push_back(alt);
  }
  return paths;
}

std::string MetaRef::HowToGive() const {
  const std::vector<std::string> paths = Paths();
  if (paths.empty()) return "not given; write it in the rule file as a number";
  return "not recorded in the checkpoint metadata (" + Join(paths, ", ") +
         "); give it as a fallback in the rule file ([" + paths.front() + ", N]) or with --set " +
         paths.front() + "=N";
}

std::string MetaRef::ToString() const {
  if (alternatives.size() == 1) return alternatives[0];
  return "[" + Join(alternatives, ", ") + "]";
}

std::string ParamRule::Describe() const {
  switch (policy) {
    case Policy::kVocab: return "vocab";
    case Policy::kReplicated:
      if (!drift) return "replicated";
      return std::string("replicated (drift ") + DriftPolicyName(*drift) + ")";
    case Policy::kSplit: break;
  }
  std::vector<std::string> details;
  if (parts > 1) details.push_back(std::to_string(parts) + " parts");
  if (!blocks.empty()) details.push_back("blocks " + blocks.ToString());
  std::string out = "split dim " + std::to_string(dim);
  return details.empty() ? out : out + " (" + Join(details, ", ") + ")";
}

std::string ParamRule::CanonicalName(const std::string& key, int layer_id, int block) const {
  std::string name;
  std::vector<std::string> groups;  // matched only when a piece needs them
  for (const NamePiece& piece : name_pieces) {
    switch (piece.kind) {
      case NamePiece::Kind::kText: name += piece.text; break;
      case NamePiece::Kind::kBlock: name += std::to_string(block); break;
      case NamePiece::Kind::kLayer: name += std::to_string(layer_id); break;
      case NamePiece::Kind::kKey: name += key; break;
      case NamePiece::Kind::kGroup:
        if (groups.empty()) groups = CaptureGroups(*key_regex, key);
        name += groups[piece.group - 1];
        break;
    }
  }
  return name;
}

int ParamRule::ExpertId(const std::string& key) const {
  if (expert == 0) return -1;
  int64_t id = -1;
  const std::vector<std::string> groups = CaptureGroups(*key_regex, key);
  return ParseInt(groups[expert - 1], &id) ? static_cast<int>(id) : -1;
}

namespace {

// Where capture group `group` of `re` lies in `key` (which it matches).
std::pair<size_t, size_t> GroupSpan(const RE2& re, const std::string& key, int group) {
  std::vector<re2::StringPiece> groups(group + 1);
  re.Match(key, 0, key.size(), RE2::ANCHOR_BOTH, groups.data(), group + 1);
  return {static_cast<size_t>(groups[group].data() - key.data()), groups[group].size()};
}

}  // namespace

std::string ParamRule::WithExpertId(const std::string& key, int id) const {
  const auto [begin, size] = GroupSpan(*key_regex, key, expert);
  return key.substr(0, begin) + std::to_string(id) + key.substr(begin + size);
}

size_t ParamRule::ExpertIdOffset(const std::string& key) const { return GroupSpan(*key_regex, key, expert).first; }

namespace {

void AddConditionPaths(const ArgConditions& conditions, std::set<std::string>* paths) {
  for (const auto& [field, expected] : conditions) paths->insert("args." + field);
}

// The paths of a shape's dims (N, path, N*path or *).
void AddShapePaths(const std::vector<std::string>& shape, std::set<std::string>* paths) {
  for (const std::string& dim : shape) {
    const std::string path = dim.substr(dim.find('*') + 1);  // npos + 1 == 0: the whole
    if (!path.empty() && !std::isdigit(static_cast<unsigned char>(path[0]))) paths->insert(path);
  }
}

// What the HF export reads: its conditions, config fields and split sizes.
void AddHfPaths(const HfExport& hf, std::set<std::string>* paths) {
  auto add_args = [paths](const ArgConditions& conditions) { AddConditionPaths(conditions, paths); };
  add_args(hf.requirements);
  for (const HfConfigField& field : hf.config) {
    paths->insert(field.paths.begin(), field.paths.end());
    for (const HfConfigField::Case& c : field.cases) {
      add_args(c.when);
      for (const HfConfigField& entry : c.entries) paths->insert(entry.paths.begin(), entry.paths.end());
    }
  }
  for (const HfTensorMap& map : hf.tensors) {
    for (const MetaRef* ref : {&map.groups, &map.heads}) {
      for (std::string& p : ref->Paths()) paths->insert(std::move(p));
    }
    AddShapePaths(map.shape, paths);
  }
}

// What a torch_dist import reads: Megatron-Core's args, the shapes' sizes,
// and how the run split its layers over the pipeline stages (Megatron-LM's
// args, which its optimizer state's layout follows).
void AddTorchDistPaths(const TorchDistLayout& layout, std::set<std::string>* paths) {
  for (const char* field : kPipelineSplitArgs) paths->insert(std::string("args.") + field);
  for (const TorchDistArg& arg : layout.args) {
    if (!arg.from.empty()) paths->insert(arg.from);
    AddConditionPaths(arg.when, paths);
  }
  for (const TorchDistTensor& t : layout.tensors) AddShapePaths(t.shape, paths);
}

}  // namespace

std::set<std::string> RuleSet::ValuePaths() const {
  std::set<std::string> paths;
  auto add = [&paths](const MetaRef& ref) {
    for (std::string& p : ref.Paths()) paths.insert(std::move(p));
  };
  for (const MetaRef* ref : {&partition_method_arg_, &vocab_original_size_, &vocab_divisible_by_,
                             &vocab_pad_to_}) {
    add(*ref);
  }
  for (const auto& [role, rules] : layers_) {
    for (const ParamRule& rule : rules) add(rule.blocks);
  }
  for (const auto& [field, expected] : detect_.args) paths.insert("args." + field);
  for (const auto& [field, expected] : pipeline_requirements_) paths.insert("args." + field);
  if (hf_) AddHfPaths(*hf_, &paths);
  if (torch_dist_) AddTorchDistPaths(*torch_dist_, &paths);
  return paths;
}

bool RuleSet::SplitModulePath(const std::string& path, std::string* role, int* block,
                              std::string* key) const {
  for (const ModulePath& m : module_paths_) {
    std::string number;
    const bool matched = m.regex->NumberOfCapturingGroups() == 2
                             ? RE2::FullMatch(path, *m.regex, &number, key)
                             : RE2::FullMatch(path, *m.regex, key);
    if (!matched) continue;
    int64_t b = -1;
    if (!number.empty() && !ParseInt(number, &b)) continue;
    *role = m.role;
    *block = static_cast<int>(b);
    return true;
  }
  return false;
}

Result<const ParamRule*> RuleSet::Match(const std::string& role, const std::string& key) const {
  const ParamRule* found = nullptr;
  auto it = layers_.find(role);
  if (it == layers_.end()) return found;
  for (const ParamRule& rule : it->second) {
    if (!RE2::FullMatch(key, *rule.key_regex)) continue;
    if (found != nullptr) {
      return Status::RuleError(origin_ + ": key '" + key + "' in " + role + " files matches rules at lines " +
                               std::to_string(found->line) + " and " + std::to_string(rule.line) +
                               "; make the patterns disjoint");
    }
    found = &rule;
  }
  return found;
}

}  // namespace reshard
