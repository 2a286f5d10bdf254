// The HF mapping a checkpoint is exported through: its family's rule set's
// hf section (rules/rule_set.h, HfExport), which the HF export and the
// torchtitan export both map the canonical tensors by.
#pragma once

#include "formats/format.h"
#include "rules/rule_set.h"

namespace reshard {

// The family's HF mapping (its rules' hf section), refused in one line when
// the checkpoint has no rule set, the rule set no hf section, or the model is
// not one the architecture computes (hf.requires). Also what the torchtitan
// export maps through.
Result<const HfExport*> FamilyExport(const SourceCheckpoint& src, const RuleInputs& inputs);

}  // namespace reshard
