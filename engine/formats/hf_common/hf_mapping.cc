#include "formats/hf_common/hf_mapping.h"

#include "logical/settings.h"

namespace reshard {

Result<const HfExport*> FamilyExport(const SourceCheckpoint& src, const RuleInputs& inputs) {
  const RuleSet* rules = src.info().rules.get();
  if (rules == nullptr) {
    return Status::Unsupported("a " + src.info().kind + " checkpoint is not described by a rule set" +
                               src.info().NoRulesWhy() + ", so reshard does not know its architecture; export --to consolidated writes its tensors");
  }
  const HfExport* hf = rules->hf();
  if (hf == nullptr) {
    return Status::Unsupported("rule set " + rules->name() + " (" + rules->description() + ") declares no HF "
                               "architecture: " + rules->origin() + " has no hf section; add one "
                               "(docs/rules.md) or export --to consolidated");
  }
  const std::string mismatch = ArgsMismatch(inputs, hf->requirements);
  if (!mismatch.empty()) {
    return Status::Unsupported(hf->architecture + " does not compute this model: " + mismatch + " (hf.requires "
                               "in " + rules->origin() + "); if the checkpoint does not record it, give the "
                               "training value with --set; else export --to consolidated");
  }
  return hf;
}

}  // namespace reshard
