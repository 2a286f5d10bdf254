// reshard::Lint: everything `convert` would object to, without writing.

#include "api/common.h"
#include "container/torch_check.h"
#include "formats/format.h"
#include "reshard/reshard.h"

namespace reshard {

bool LintReport::ok() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return false;
  }
  return true;
}

Result<LintReport> Lint(const std::string& checkpoint, const LintOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> src, OpenCheckpoint(checkpoint, options));
  RESHARD_RETURN_IF_ERROR(CheckVocabSize(*src, options.vocab_size));
  LintReport report;
  report.summary = src->Summary();
  report.findings = src->findings();
  src->Lint(options, &report);
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
