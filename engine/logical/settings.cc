#include "logical/settings.h"

#include "util/strings.h"

namespace reshard {
namespace {

std::string FullPath(const std::string& key) {
  return key.find('.') == std::string::npos ? "args." + key : key;
}

// Calls f(path, value) for every leaf under `v`.
template <typename F>
void ForEachLeaf(const Value& v, const std::string& prefix, F f) {
  const Items* items = DictItems(v);
  if (items == nullptr) {
    f(prefix, v);
    return;
  }
  for (const auto& [key, child] : *items) {
    ForEachLeaf(child, prefix.empty() ? key.as_string() : prefix + "." + key.as_string(), f);
  }
}

// An enum member in `args` reads as it was pickled: by name
// (getattr(Enum, 'alibi'), Python >= 3.11) or by value (Enum(3), before);
// any other object as its debug form.
std::string EnumText(const Value& v) {
  const Object& o = v.as_object();
  if (o.cls.Is("builtins", "getattr") && o.args.size() == 2 && o.args[1].is(Value::Kind::kString)) {
    return o.args[1].as_string();
  }
  if (o.args.size() == 1 && o.args[0].is(Value::Kind::kInt)) return std::to_string(o.args[0].as_int());
  return v.DebugString();
}

// Whether a setting says what the checkpoint records: numbers by value
// (--set lr=1e-4 is a run's 0.0001), anything else as YAML writes it.
bool SameValue(const Value& recorded, const Value& given) {
  auto number = [](const Value& v) -> std::optional<double> {
    if (v.is(Value::Kind::kFloat)) return v.as_float();
    if (v.is(Value::Kind::kInt)) return static_cast<double>(v.as_int());
    return std::nullopt;
  };
  const std::optional<double> a = number(recorded), b = number(given);
  if (a && b) return *a == *b;
  return ScalarText(recorded) == ScalarText(given);
}

}  // namespace

const std::set<std::string>& RunValuePaths() {
  static const std::set<std::string> kPaths = {"args.lr", "args.min_lr", "args.global_batch_size"};
  return kPaths;
}

void SetPath(Value* root, const std::string& path, Value value) {
  const size_t dot = path.find('.');
  if (dot == std::string::npos) {
    Set(*root, path, std::move(value));
    return;
  }
  const std::string head = path.substr(0, dot);
  Value* child = FindMutable(*root, head);
  if (child == nullptr || DictItems(*child) == nullptr) {
    Set(*root, head, Value::MakeDict());
    child = FindMutable(*root, head);
  }
  SetPath(child, path.substr(dot + 1), std::move(value));
}

std::string ScalarText(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kBool: return v.as_bool() ? "true" : "false";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kString: return v.as_string();
    case Value::Kind::kObject: return EnumText(v);
    default: return v.DebugString();
  }
}

std::optional<Value> ValueThatHolds(const std::string& expected) {
  if (expected == "null" || expected == "*") return std::nullopt;
  if (!expected.empty() && expected[0] == '!') {
    if (expected == "!true") return Value::Bool(false);
    if (expected == "!false") return Value::Bool(true);
    return std::nullopt;
  }
  return ScalarValue(expected.substr(0, expected.find('|')));
}

bool ArgHolds(const RuleInputs& inputs, const std::string& field, const std::string& expected) {
  if (!expected.empty() && expected[0] == '!') return !ArgHolds(inputs, field, expected.substr(1));
  if (const size_t bar = expected.find('|'); bar != std::string::npos) {
    return ArgHolds(inputs, field, expected.substr(0, bar)) || ArgHolds(inputs, field, expected.substr(bar + 1));
  }
  const Value* v = inputs.Find("args." + field);
  if (expected == "null") return v == nullptr;
  if (expected == "*") return v != nullptr;
  return v != nullptr && ScalarText(*v) == expected;
}

std::string ArgsMismatch(const RuleInputs& inputs, const ArgConditions& conditions) {
  for (const auto& [field, expected] : conditions) {
    if (ArgHolds(inputs, field, expected)) continue;
    const bool negated = !expected.empty() && expected[0] == '!';
    return "args." + field + (negated ? " is " + expected.substr(1) : " is not " + expected);
  }
  return "";
}

Result<Value> SettingsValue(const std::map<std::string, std::string>& set) {
  Value root = Value::MakeDict();
  for (const auto& [key, text] : set) {
    if (key.empty() || key.front() == '.' || key.back() == '.' ||
        key.find("..") != std::string::npos) {
      return Status::InvalidInput("--set " + key + "=" + text +
                                  ": give a metadata path such as args.num_attention_heads=16");
    }
    SetPath(&root, FullPath(key), ScalarValue(text));
  }
  return root;
}

Status RefuseSettings(const std::map<std::string, std::string>& set) {
  if (set.empty()) return Status::Ok();
  return Status::InvalidInput("--set " + set.begin()->first +
                              ": this checkpoint has no layer files for rules to describe, so "
                              "nothing reads it; drop the --set");
}

Status CheckSettings(const Value& settings, const RuleSet& rules, const Value& metadata) {
  std::set<std::string> read = rules.ValuePaths();
  read.insert(RunValuePaths().begin(), RunValuePaths().end());
  Status status = Status::Ok();
  ForEachLeaf(settings, "", [&](const std::string& path, const Value& value) {
    if (!status.ok()) return;
    if (!read.count(path)) {
      const std::vector<std::string> names(read.begin(), read.end());
      const std::string* typo = ClosestName(path, names);
      status = Status::InvalidInput("--set " + path + ": rule set " + rules.name() + " reads no such value" +
                                    (typo != nullptr ? "; did you mean '" + *typo + "'?"
                                     : read.empty()  ? ""
                                                     : " (--set gives " + Join(names, ", ") + ")"));
      return;
    }
    const Value* recorded = WalkPath(metadata, path);
    if (recorded != nullptr && !SameValue(*recorded, value)) {
      status = Status::InvalidInput("--set " + path + "=" + ScalarText(value) +
                                    " contradicts the checkpoint, which records " + path + " = " +
                                    ScalarText(*recorded) + "; drop the --set");
    }
  });
  return status;
}

}  // namespace reshard
