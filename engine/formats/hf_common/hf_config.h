// config.json of an HF export: what the transformers architecture is told
// about the model. `architectures`, `vocab_size` (the vocabulary without its
// padding rows) and `torch_dtype` come from the exported tensors; every other
// field is the rule file's hf.config, each value read from the checkpoint's
// metadata (or --set) as the field says. A value the checkpoint does not
// record is asked for, never guessed. An HF source's other fields are kept;
// special token ids may come from the tokenizer's files.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "formats/hf_common/hf_rules.h"
#include "pickle/dtype.h"
#include "plan/tensor_plan.h"
#include "reshard/status.h"
#include "rules/rule_set.h"

namespace reshard {

// The value of one hf.config field; an error naming how to give it when the
// checkpoint does not record it.
Result<Value> HfConfigValue(const HfConfigField& field, const RuleInputs& inputs);

// The hf.config fields the checkpoint does not record a value for, each
// with how to give it: what an export names in one refusal with the other
// values it lacks.
std::vector<MissingValue> MissingHfConfigValues(const HfExport& hf, const RuleInputs& inputs);

// What config.json carries beside what the conversion writes.
struct HfConfigExtras {
  // An HF source's own config.json: every field the conversion does not
  // write (bos_token_id, use_cache, ...) is kept as it is. Null: none.
  const Value* source = nullptr;
  // Special token ids read from --tokenizer's files ("eos_token_id", 2),
  // written where neither the source nor the rules give the key.
  std::vector<std::pair<std::string, int64_t>> token_ids;
};

// The whole file, keys in the order written: the source's (`extras`), then
// architectures, the rule file's fields, vocab_size, torch_dtype (each in
// the source's place when it has the key), then the token ids.
Result<std::string> HfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size, DType dtype,
                                 const HfConfigExtras& extras = {});

// HfConfigJson without extras, each rule-file field the checkpoint does not
// record left out instead of asked for (`left_out` learns their keys): what
// an export that keeps the model's config beside files of its own records
// (torchtitan_export.h's reshard-model.json).
Result<std::string> RecordedHfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size,
                                         DType dtype, std::vector<std::string>* left_out);

}  // namespace reshard
