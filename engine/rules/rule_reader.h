// RuleReader: typed reading of a rule file's YAML, for the core parser
// (rule_parser.cc) and for the formats that parse their own sections
// (rule_section.h). Every problem is reported as one line naming the file,
// the line and the fix ("rules/x.yaml:12: hf.tensors from must be a
// string"), and reading goes on, so that an author fixes all of them in one
// pass; copies of a reader report into the same list.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "rules/rule_set.h"

namespace reshard {

// A YAML node and the 1-based line it is on, for messages.
struct Field {
  YAML::Node node;
  int line = 0;
};

// The fields of one mapping, by name.
using Fields = std::map<std::string, Field>;

// yaml-cpp marks are 0-based and -1 for nodes it made up (absent values).
int LineOf(const YAML::Node& n, int fallback);

// A Python-style identifier: an args field, a config.json key, a role.
bool IsIdentifier(const std::string& s);
// `args.num_attention_heads`: identifiers joined by dots.
bool IsDottedPath(const std::string& s);

class RuleReader {
 public:
  // Reports into `errors`, each line prefixed with `origin` (the file).
  RuleReader(std::string origin, std::vector<std::string>* errors) : origin_(std::move(origin)), errors_(errors) {}

  void Fail(int line, const std::string& msg);
  void Fail(const Field& f, const std::string& msg) { Fail(f.line, msg); }
  size_t error_count() const { return errors_->size(); }

  // The entries of mapping `f`, reporting unknown (misspelt) and repeated
  // names. Nullopt when `f` is not a mapping.
  std::optional<Fields> ReadFields(const Field& f, const std::string& where, const std::vector<std::string>& allowed);
  static const Field* Get(const Fields& fields, const std::string& name);
  // The items of a sequence, each with its own line.
  static std::vector<Field> Items(const Field& f);

  std::optional<std::string> ReadString(const Field& f, const std::string& what);
  std::optional<bool> ReadBool(const Field& f, const std::string& what);
  std::optional<int64_t> ReadInt(const Field& f, const std::string& what);
  std::vector<std::string> ReadStringList(const Field& f, const std::string& what);
  // Field `name` of `fields`, when given, as true or false into `out`.
  void ReadFlag(const Fields& fields, const std::string& name, bool* out);
  // An integer, a dotted metadata path, or a list of those (tried in order).
  MetaRef ReadMetaRef(const Field& f, const std::string& what);
  // A list of dims, each an integer, a metadata path, N*path or * (any).
  std::vector<std::string> ReadShape(const Field& f, const std::string& what);
  // A mapping of args field -> expected value (detect.args, hf.requires, a case's when).
  ArgConditions ReadArgConditions(const Field& f, const std::string& what);
  // Reports `text` unless it is a size expression (size_expression.h).
  void CheckSize(const Field& f, const std::string& text);

  // A YAML scalar as the value it stands for; always a string when quoted.
  static Value Literal(const YAML::Node& n);

 private:
  // One alternative of a size: a positive integer or a dotted path.
  std::optional<std::string> ReadSize(const Field& f, const std::string& what);

  std::string origin_;
  std::vector<std::string>* errors_;
};

}  // namespace reshard
