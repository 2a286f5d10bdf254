#include "formats/hf_common/hf_config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "container/safetensors_writer.h"
#include "formats/hf_common/hf_rules.h"
#include "logical/settings.h"
#include "pickle/value.h"
#include "util/strings.h"

namespace reshard {
namespace {

// `v` as JSON; an error for what config.json cannot hold. Lists and dicts
// (`containers`) come only from an HF source's own config.json (nested
// fields such as task_specific_params), never from a run's metadata.
Result<std::string> Json(const Value& v, const std::string& what, bool containers = false) {
  switch (v.kind()) {
    case Value::Kind::kNone: return std::string("null");
    case Value::Kind::kBool: return std::string(v.as_bool() ? "true" : "false");
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      if (std::isfinite(v.as_float())) return v.DebugString();  // Python's repr: shortest exact digits
      break;
    case Value::Kind::kString: return JsonString(v.as_string());
    case Value::Kind::kList: {
      if (!containers) break;
      std::string out;
      for (const Value& item : v.as_list().items) {
        RESHARD_ASSIGN_OR_RETURN(std::string text, Json(item, what, true));
        out += (out.empty() ? "" : ", ") + text;
      }
      return "[" + out + "]";
    }
    case Value::Kind::kDict: {
      if (!containers) break;
      std::string out;
      for (const auto& [key, item] : v.as_dict().items) {
        if (!key.is(Value::Kind::kString)) break;
        RESHARD_ASSIGN_OR_RETURN(std::string text, Json(item, what + "." + key.as_string(), true));
        out += (out.empty() ? "" : ", ") + JsonString(key.as_string()) + ": " + text;
      }
      return "{" + out + "}";
    }
    default: break;
  }
  return Status::InvalidInput(what + " is " + v.DebugString(60) + ", not a number, boolean or string");
}

// Appends key: text, or replaces the value of a key already there.
void Put(std::vector<std::pair<std::string, std::string>>* fields, const std::string& key, std::string text) {
  for (auto& field : *fields) {
    if (field.first == key) {
      field.second = std::move(text);
      return;
    }
  }
  fields->emplace_back(key, std::move(text));
}

// The args fields a field's cases read, for the message when none holds.
std::vector<std::string> CaseFields(const HfConfigField& field) {
  std::set<std::string> fields;
  for (const HfConfigField::Case& c : field.cases) {
    for (const auto& [name, expected] : c.when) fields.insert("args." + name);
  }
  return {fields.begin(), fields.end()};
}

// A case's value: its literal, or its mapping with every entry read.
Result<Value> CaseValue(const HfConfigField::Case& c, const RuleInputs& inputs) {
  if (c.entries.empty()) return *c.value;
  Value mapping = Value::MakeDict();
  for (const HfConfigField& entry : c.entries) {
    RESHARD_ASSIGN_OR_RETURN(Value v, HfConfigValue(entry, inputs));
    Set(mapping, entry.key, std::move(v));
  }
  return mapping;
}

Result<Value> FromCases(const HfConfigField& field, const RuleInputs& inputs) {
  for (const HfConfigField::Case& c : field.cases) {
    if (ArgsMismatch(inputs, c.when).empty()) return CaseValue(c, inputs);
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

std::vector<MissingValue> MissingHfConfigValues(const HfExport& hf, const RuleInputs& inputs) {
  std::vector<MissingValue> missing;
  for (const HfConfigField& field : hf.config) {
    if (HfConfigValue(field, inputs).ok()) continue;
    // A field of cases is given by the last args field they read; one of paths by its first.
    const std::vector<std::string> paths = field.cases.empty() ? field.paths : CaseFields(field);
    if (paths.empty()) continue;  // nothing to give: HfConfigValue's own refusal says why
    const std::string& given = field.cases.empty() ? paths.front() : paths.back();
    missing.push_back({"config.json " + field.key + " (" + Join(paths, field.cases.empty() ? " or " : ", ") + ")",
                       "--set " + given + "=N"});
  }
  return missing;
}

namespace {

// The rule file's fields, each as JSON text, into `fields`. Without
// `left_out`, a field the checkpoint does not record is an error; with it,
// it is left out and named there.
Status PutRuleFields(const HfExport& hf, const RuleInputs& inputs, std::vector<std::pair<std::string, std::string>>* fields,
                     std::vector<std::string>* left_out) {
  for (const HfConfigField& field : hf.config) {
    Result<std::string> text = [&]() -> Result<std::string> {
      RESHARD_ASSIGN_OR_RETURN(Value value, HfConfigValue(field, inputs));
      // Only a case's mapping (rope_scaling) is a container.
      return Json(value, "config.json " + field.key, !field.cases.empty());
    }();
    if (!text.ok() && left_out == nullptr) return text.status();
    if (!text.ok()) {
      left_out->push_back(field.key);
      continue;
    }
    Put(fields, field.key, std::move(*text));
  }
  return Status::Ok();
}

std::string JsonObject(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string json;
  for (const auto& [key, text] : fields) json += (json.empty() ? "{\n  " : ",\n  ") + JsonString(key) + ": " + text;
  return json + "\n}\n";
}

}  // namespace

Result<std::string> RecordedHfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size,
                                         DType dtype, std::vector<std::string>* left_out) {
  std::vector<std::pair<std::string, std::string>> fields = {{"architectures", "[" + JsonString(hf.architecture) + "]"}};
  RESHARD_RETURN_IF_ERROR(PutRuleFields(hf, inputs, &fields, left_out));
  Put(&fields, "vocab_size", std::to_string(vocab_size));
  Put(&fields, "torch_dtype", JsonString(DTypeName(dtype)));
  return JsonObject(fields);
}

Result<std::string> HfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size, DType dtype,
                                 const HfConfigExtras& extras) {
  // The source's fields first, in its order, so that the ones written below
  // replace their values in place.
  std::vector<std::pair<std::string, std::string>> fields;
  if (extras.source != nullptr) {
    for (const auto& [key, value] : extras.source->as_dict().items) {
      if (!key.is(Value::Kind::kString)) continue;
      RESHARD_ASSIGN_OR_RETURN(std::string text, Json(value, "the source's config.json " + key.as_string(), true));
      fields.emplace_back(key.as_string(), std::move(text));
    }
  }
  Put(&fields, "architectures", "[" + JsonString(hf.architecture) + "]");
  RESHARD_RETURN_IF_ERROR(PutRuleFields(hf, inputs, &fields, nullptr));
  Put(&fields, "vocab_size", std::to_string(vocab_size));
  Put(&fields, "torch_dtype", JsonString(DTypeName(dtype)));
  for (const auto& [key, id] : extras.token_ids) {
    if (std::none_of(fields.begin(), fields.end(), [&](const auto& f) { return f.first == key; })) {
      fields.emplace_back(key, std::to_string(id));
    }
  }
  return JsonObject(fields);
}

}  // namespace reshard
