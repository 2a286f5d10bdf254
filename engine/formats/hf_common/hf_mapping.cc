#include "formats/hf_common/hf_mapping.h"

#include "formats/hf_common/hf_config.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "logical/settings.h"

namespace reshard {

Result<const HfExport*> FamilyExport(const SourceCheckpoint& src, const RuleInputs& inputs) {
  const RuleSet* rules = src.info().rules.get();
  if (rules == nullptr) {
    return Status::Unsupported("a " + src.info().kind + " checkpoint is not described by a rule set" +
                               src.info().NoRulesWhy() + ", so reshard does not know its architecture; export --to consolidated writes its tensors");
  }
  const HfExport* hf = rules->section<HfExport>();
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

Result<int64_t> VocabRows(const std::vector<ChosenTensor>& chosen, const std::vector<FullTensor>& all) {
  for (const ChosenTensor& t : chosen) {
    if (all[t.source].vocab) return t.shape[0];
  }
  return Status::Unsupported("the checkpoint has no vocabulary tensor, so config.json has no vocab_size");
}

DType FloatingDType(const std::vector<ChosenTensor>& chosen) {
  for (const ChosenTensor& t : chosen) {
    if (IsFloatingPoint(t.dtype)) return t.dtype;
  }
  return DType::kFloat32;
}

Result<std::string> RecordedConfigJson(const HfExport& hf, const RuleInputs& inputs,
                                       const std::vector<ChosenTensor>& chosen, const std::vector<FullTensor>& all,
                                       std::vector<std::string>* left_out) {
  RESHARD_ASSIGN_OR_RETURN(int64_t vocab, VocabRows(chosen, all));
  return RecordedHfConfigJson(hf, inputs, vocab, FloatingDType(chosen), left_out);
}

std::string CanonicalOfHf(const HfExport& hf, const std::string& name) {
  for (const HfTensorMap& map : hf.tensors) {
    for (const std::string& to : map.to) {
      std::string block, expert;
      if (HfNameTemplate(to).Match(name, &block, &expert)) return HfNameTemplate(map.from).With(block, expert);
    }
  }
  return name;
}

}  // namespace reshard
