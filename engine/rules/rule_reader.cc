#include "rules/rule_reader.h"

#include <re2/re2.h>

#include <algorithm>

#include "pickle/value.h"
#include "rules/size_expression.h"
#include "util/strings.h"

namespace reshard {
namespace {

// detect.args values as the detector compares them: null spelled "null",
// unquoted booleans spelled "true"/"false", anything else as written.
std::optional<std::string> DetectValue(const YAML::Node& n) {
  if (n.IsNull()) return "null";
  if (!n.IsScalar()) return std::nullopt;
  std::string s = n.Scalar();
  bool quoted = n.Tag() == "!";
  if (!quoted && (s == "True" || s == "TRUE")) return "true";
  if (!quoted && (s == "False" || s == "FALSE")) return "false";
  return s;
}

}  // namespace

int LineOf(const YAML::Node& n, int fallback) {
  int line = n.Mark().line;
  return line >= 0 ? line + 1 : fallback;
}

bool IsIdentifier(const std::string& s) {
  static const RE2 re("[A-Za-z_][A-Za-z0-9_]*");
  return RE2::FullMatch(s, re);
}

bool IsDottedPath(const std::string& s) {
  static const RE2 re("[A-Za-z_][A-Za-z0-9_]*(\\.[A-Za-z_][A-Za-z0-9_]*)*");
  return RE2::FullMatch(s, re);
}

void RuleReader::Fail(int line, const std::string& msg) {
  errors_->push_back(origin_ + (line > 0 ? ":" + std::to_string(line) : "") + ": " + msg);
}

std::optional<Fields> RuleReader::ReadFields(const Field& f, const std::string& where,
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

const Field* RuleReader::Get(const Fields& fields, const std::string& name) {
  auto it = fields.find(name);
  return it == fields.end() ? nullptr : &it->second;
}

std::vector<Field> RuleReader::Items(const Field& f) {
  std::vector<Field> items;
  for (const auto& item : f.node) items.push_back(Field{item, LineOf(item, f.line)});
  return items;
}

std::optional<std::string> RuleReader::ReadString(const Field& f, const std::string& what) {
  if (f.node.IsScalar()) return f.node.Scalar();
  Fail(f, what + " must be a string");
  return std::nullopt;
}

std::optional<bool> RuleReader::ReadBool(const Field& f, const std::string& what) {
  if (f.node.IsScalar() && (f.node.Scalar() == "true" || f.node.Scalar() == "false")) {
    return f.node.Scalar() == "true";
  }
  Fail(f, what + " must be true or false");
  return std::nullopt;
}

std::optional<int64_t> RuleReader::ReadInt(const Field& f, const std::string& what) {
  int64_t n = 0;
  if (f.node.IsScalar() && ParseInt(f.node.Scalar(), &n)) return n;
  Fail(f, what + " must be an integer");
  return std::nullopt;
}

std::vector<std::string> RuleReader::ReadStringList(const Field& f, const std::string& what) {
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

void RuleReader::ReadFlag(const Fields& fields, const std::string& name, bool* out) {
  if (const Field* f = Get(fields, name)) {
    if (auto b = ReadBool(*f, name)) *out = *b;
  }
}

MetaRef RuleReader::ReadMetaRef(const Field& f, const std::string& what) {
  MetaRef ref;
  std::vector<Field> items = f.node.IsSequence() ? Items(f) : std::vector<Field>{f};
  if (items.empty()) Fail(f, what + " is an empty list; give at least one size or path");
  for (const Field& item : items) {
    if (auto alternative = ReadSize(item, what)) ref.alternatives.push_back(*alternative);
  }
  return ref;
}

std::optional<std::string> RuleReader::ReadSize(const Field& f, const std::string& what) {
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

std::vector<std::string> RuleReader::ReadShape(const Field& f, const std::string& what) {
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

ArgConditions RuleReader::ReadArgConditions(const Field& f, const std::string& what) {
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

void RuleReader::CheckSize(const Field& f, const std::string& text) {
  Result<SizeExpression> e = ParseSizeExpression(text);
  if (!e.ok()) Fail(f, e.status().message());
}

Value RuleReader::Literal(const YAML::Node& n) {
  return n.Tag() == "!" ? Value::String(n.Scalar()) : ScalarValue(n.Scalar());
}

}  // namespace reshard
