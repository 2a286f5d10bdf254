// `export --to hf`: a Hugging Face transformers folder — config.json, the
// weights as model.safetensors (or shards with model.safetensors.index.json),
// and the tokenizer files of --tokenizer — for a family whose rule file
// declares an hf section (rules/rule_set.h, HfExport; docs/rules.md).
//
// It is the consolidated export renamed and reordered: each parameter chosen
// whole from the source (its bf16/fp16 weight, or its fp32 master with
// --from masters; vocabulary padding stripped), then mapped by
// formats/hf_common/hf_tensors.h, and written by formats/state_dict.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/state_dict.h"

namespace reshard {

// `export --to hf`: its options and its planner.
TargetFormat HfTarget();

}  // namespace reshard
