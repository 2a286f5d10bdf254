#include "formats/hf/hf_config.h"

#include <cmath>
#include <set>

#include "container/safetensors_writer.h"
#include "logical/settings.h"
#include "pickle/value.h"
#include "util/strings.h"

namespace reshard {
namespace {

// `v` as JSON; an error for what config.json cannot hold.
Result<std::string> Json(const Value& v, const std::string& what) {
  switch (v.kind()) {
    case Value::Kind::kNone: return std::string("null");
    case Value::Kind::kBool: return std::string(v.as_bool() ? "true" : "false");
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      if (std::isfinite(v.as_float())) return v.DebugString();  // Python's repr: shortest exact digits
      break;
    case Value::Kind::kString: return JsonString(v.as_string());
    default: break;
  }
  return Status::InvalidInput(what + " is " + v.DebugString(60) + ", not a number, boolean or string");
}

// The args fields a field's cases read, for the message when none holds.
std::vector<std::string> CaseFields(const HfConfigField& field) {
  std::set<std::string> fields;
  for (const HfConfigField::Case& c : field.cases) {
    for (const auto& [name, expected] : c.when) fields.insert("args." + name);
  }
  return {fields.begin(), fields.end()};
}

Result<Value> FromCases(const HfConfigField& field, const RuleInputs& inputs) {
  for (const HfConfigField::Case& c : field.cases) {
    if (ArgsMismatch(inputs, c.when).empty()) return *c.value;
  }
  const std::vector<std::string> fields = CaseFields(field);
  return Status::InvalidInput("config.json " + field.key + " depends on " + Join(fields, ", ") +
                              " (hf.config line " + std::to_string(field.line) + "), and no case fits what "
                              "the checkpoint records; give the value it was trained with, e.g. --set " +
                              fields.back().substr(5) + "=VALUE");
}

}  // namespace

Result<Value> HfConfigValue(const HfConfigField& field, const RuleInputs& inputs) {
  if (!field.cases.empty()) return FromCases(field, inputs);
  for (const std::string& path : field.paths) {
    if (const Value* v = inputs.Find(path)) return *v;
  }
  if (field.literal) return *field.literal;
  const std::string& first = field.paths.front();
  return Status::InvalidInput("config.json " + field.key + " is " + Join(field.paths, " or ") +
                              ", which the checkpoint does not record; give it with --set " +
                              (first.rfind("args.", 0) == 0 ? first.substr(5) : first) + "=VALUE");
}

Result<std::string> HfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size, DType dtype) {
  std::string json = "{\n  \"architectures\": [" + JsonString(hf.architecture) + "]";
  for (const HfConfigField& field : hf.config) {
    RESHARD_ASSIGN_OR_RETURN(Value value, HfConfigValue(field, inputs));
    RESHARD_ASSIGN_OR_RETURN(std::string text, Json(value, "config.json " + field.key));
    json += ",\n  " + JsonString(field.key) + ": " + text;
  }
  json += ",\n  \"vocab_size\": " + std::to_string(vocab_size);
  json += ",\n  \"torch_dtype\": " + JsonString(DTypeName(dtype));
  return json + "\n}\n";
}

}  // namespace reshard
