// reshard::Lint: everything `convert` would object to, without writing.

#include "api/common.h"
#include "container/torch_check.h"
#include "formats/registry.h"
#include "reshard/reshard.h"

namespace reshard {

bool LintReport::ok() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return false;
  }
  return true;
}

namespace {

// What convert to the target layout (without one, to the source's own)
// would refuse, found by planning it as convert does (which reads metadata
// only) with the options lint was given.
void LintConversion(const SourceCheckpoint& src, const LintOptions& options, LintReport* report) {
  ConvertOptions convert;
  static_cast<PreflightOptions&>(convert) = options;
  convert.to = options.to;
  convert.target_tp = options.target_tp;
  convert.target_pp = options.target_pp;
  convert.target_dp = options.target_dp;
  convert.target_ep = options.target_ep;
  convert.dry_run = true;
  std::vector<std::string> notes;
  Result<OutputPlan> plan = PlanConvert(src, convert, &notes);
  if (!plan.ok()) report->findings.push_back({Finding::Severity::kError, plan.status().message()});
}

}  // namespace

Result<LintReport> Lint(const std::string& checkpoint, const LintOptions& options) {
  if (!options.to.empty()) RESHARD_RETURN_IF_ERROR(CheckTargetFormat(options.to));
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> src, OpenCheckpoint(checkpoint, options));
  RESHARD_RETURN_IF_ERROR(CheckVocabSize(*src, options.vocab_size));
  LintReport report;
  report.summary = src->info().summary;
  report.findings = src->info().findings;
  report.notes = OpenNotes(*src, options);
  src->Lint(options, &report);
  // Without a target, the conversion to the source's own format and layout,
  // where it records its layout (else convert needs to be told one).
  const bool target = !options.to.empty() || options.target_tp > 0 || options.target_pp > 0 || options.target_dp > 0 ||
                      options.target_ep > 0;
  if (report.ok() && (target || RecordsItsLayout(*src))) LintConversion(*src, options, &report);
  if (options.deep) {
    // LibTorch's reader reads every file as well: a second, independent
    // reader of the container, which reshard otherwise reads on its own.
    Result<const TorchCheck*> torch = TorchCheck::Load();
    if (!torch.ok()) report.notes.push_back("the LibTorch cross-check was skipped: " + torch.status().message());
    std::vector<std::string> damaged;
    RESHARD_RETURN_IF_ERROR(CheckRecordCrcs(*src, ThreadCount(options.threads), torch.ok() ? *torch : nullptr,
                                            options.progress, &damaged));
    for (const std::string& message : damaged) report.findings.push_back({Finding::Severity::kError, message});
  }
  return report;
}

}  // namespace reshard
