// config.json of an HF export: what the transformers architecture is told
// about the model. `architectures`, `vocab_size` (the vocabulary without its
// padding rows) and `torch_dtype` come from the exported tensors; every other
// field is the rule file's hf.config, each value read from the checkpoint's
// metadata (or --set) as the field says. A value the checkpoint does not
// record is asked for, never guessed.
#pragma once

#include <cstdint>
#include <string>

#include "pickle/dtype.h"
#include "reshard/status.h"
#include "rules/rule_set.h"

namespace reshard {

// The value of one hf.config field; an error naming how to give it when the
// checkpoint does not record it.
Result<Value> HfConfigValue(const HfConfigField& field, const RuleInputs& inputs);

// The whole file, keys in the order written: architectures, the rule file's
// fields, vocab_size, torch_dtype.
Result<std::string> HfConfigJson(const HfExport& hf, const RuleInputs& inputs, int64_t vocab_size, DType dtype);

}  // namespace reshard
