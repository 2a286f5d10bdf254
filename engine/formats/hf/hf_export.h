// `export --to hf`: a Hugging Face transformers folder — config.json, the
// weights as model.safetensors (or shards with model.safetensors.index.json),
// and the tokenizer files of --tokenizer — for a family whose rule file
// declares an hf section (rules/rule_set.h, HfExport; docs/rules.md).
//
// It is the consolidated export renamed and reordered: each parameter chosen
// whole from the source (its bf16/fp16 weight, or its fp32 master with
// --from masters; vocabulary padding stripped), then mapped by
// formats/hf/hf_tensors.h, and written by formats/state_dict.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/state_dict.h"

namespace reshard {

// The family's HF mapping (its rules' hf section), refused in one line when
// the checkpoint has no rule set, the rule set no hf section, or the model is
// not one the architecture computes (hf.requires). Also what the torchtitan
// export maps through.
Result<const HfExport*> FamilyExport(const SourceCheckpoint& src, const RuleInputs& inputs);

// Plans the folder. `src` must outlive the plan and its jobs.
// The HF config of the model `chosen` (ChooseTensors' choice of `all`) as
// far as the checkpoint records it: RecordedHfConfigJson (hf_config.h) with
// the chosen tensors' vocabulary rows and dtype.
Result<std::string> RecordedConfigJson(const HfExport& hf, const RuleInputs& inputs,
                                       const std::vector<ChosenTensor>& chosen, const std::vector<FullTensor>& all,
                                       std::vector<std::string>* left_out);

Result<OutputPlan> PlanHf(const SourceCheckpoint& src, const ExportOptions& options,
                                           std::vector<std::string>* notes);

}  // namespace reshard
