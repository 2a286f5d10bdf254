// The HF mapping a checkpoint is exported through: its family's rule set's
// hf section (rules/rule_set.h, HfExport), which the HF export and the
// torchtitan export both map the canonical tensors by.
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/state_dict.h"
#include "rules/rule_set.h"

namespace reshard {

// The family's HF mapping (its rules' hf section), refused in one line when
// the checkpoint has no rule set, the rule set no hf section, or the model is
// not one the architecture computes (hf.requires). Also what the torchtitan
// export maps through.
Result<const HfExport*> FamilyExport(const SourceCheckpoint& src, const RuleInputs& inputs);

// config.json's vocab_size: the rows of the (stripped) vocabulary tensors
// among `chosen` (ChooseTensors' choice of `all`).
Result<int64_t> VocabRows(const std::vector<ChosenTensor>& chosen, const std::vector<FullTensor>& all);

// config.json's torch_dtype: the dtype of the floating tensors (the first,
// as stored or cast; they are alike unless a buffer keeps another).
DType FloatingDType(const std::vector<ChosenTensor>& chosen);

// The HF config of the model `chosen` as far as the checkpoint records it:
// RecordedHfConfigJson (hf_config.h) with the chosen tensors' vocabulary
// rows and dtype; `left_out` learns the fields it does not record.
Result<std::string> RecordedConfigJson(const HfExport& hf, const RuleInputs& inputs,
                                       const std::vector<ChosenTensor>& chosen, const std::vector<FullTensor>& all,
                                       std::vector<std::string>* left_out);

// The canonical parameter the HF tensor `name` is (a part of): the
// hf.tensors entry that makes it, at its block; `name` itself when none does.
std::string CanonicalOfHf(const HfExport& hf, const std::string& name);

}  // namespace reshard
