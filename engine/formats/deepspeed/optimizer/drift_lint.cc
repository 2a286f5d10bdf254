#include "formats/deepspeed/optimizer/drift_lint.h"

#include "formats/deepspeed/optimizer/state_tensor.h"
#include "logical/drift.h"
#include "plan/tensor_plan.h"

namespace reshard {
namespace {

// Drift convert refuses (the tensor's policy is `check`) is an error, drift
// it merges a warning.
Finding::Severity DriftSeverity(const ParamRule& rule, ReplicatedPolicy policy) {
  return PolicyFor(rule, policy) == ReplicatedPolicy::kCheck ? Finding::Severity::kError
                                                             : Finding::Severity::kWarning;
}

// Lists drifts largest first, `max_lines` of them, each as `describe(i)`,
// after a summary line; each line as severe as its drift (the summary as
// the worst).
template <typename Describe, typename SeverityOf>
void ReportDrifts(size_t count, const std::string& summary, const std::string& prefix, int max_lines,
                  Describe describe, SeverityOf severity_of, LintReport* report) {
  if (count == 0) return;
  Finding::Severity worst = Finding::Severity::kWarning;
  for (size_t i = 0; i < count; ++i) {
    if (severity_of(i) == Finding::Severity::kError) worst = Finding::Severity::kError;
  }
  report->findings.push_back({worst, std::to_string(count) + summary});
  for (size_t i = 0; i < count && static_cast<int>(i) < max_lines; ++i) {
    report->findings.push_back({severity_of(i), prefix + describe(i)});
  }
  if (static_cast<int>(count) > max_lines) {
    report->findings.push_back({worst, prefix + "... and " + std::to_string(count - max_lines) + " more"});
  }
}

}  // namespace

void ReportDrift(const LogicalCheckpoint& ckpt, const LintOptions& options, LintReport* report) {
  const std::vector<Drift> drifts = MeasureDrift(ckpt);
  ReportDrifts(
      drifts.size(),
      " replicated tensor(s) differ across TP ranks; convert refuses them unless you choose "
      "--replicated average (mean) or --replicated first (TP rank 0)",
      "drift: ", options.max_drift_lines, [&](size_t i) { return DescribeDrift(ckpt, drifts[i]); },
      [&](size_t i) {
        const Drift& d = drifts[i];
        return DriftSeverity(*ckpt.layers[d.layer_index].tensors[d.tensor_index].rule, options.replicated);
      },
      report);
}

void ReportStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt,
                      const LintOptions& options, LintReport* report) {
  Result<std::vector<StateDrift>> drifts = MeasureStateDrift(ckpt, opt);
  if (!drifts.ok()) {
    report->findings.push_back({Finding::Severity::kError, "optimizer: " + drifts.status().message()});
    return;
  }
  const std::vector<StateDrift>& d = *drifts;
  ReportDrifts(
      d.size(),
      " optimizer state(s) of replicated parameters differ across TP ranks; convert refuses them "
      "unless you choose --replicated average or --replicated first",
      "optimizer drift: ", options.max_drift_lines,
      [&](size_t i) {
        return "'" + d[i].state + "' of " + d[i].name + " differs between TP ranks 0 and " +
               std::to_string(d[i].rank);
      },
      [&](size_t i) { return DriftSeverity(*d[i].rule, options.replicated); }, report);
}

Status CheckWeightDrift(const LogicalCheckpoint& ckpt, ReplicatedPolicy policy, std::vector<std::string>* notes) {
  const std::vector<Drift> drifts = MeasureDrift(ckpt);
  int checked = 0, merged = 0;
  const Drift* worst_checked = nullptr;
  for (const Drift& d : drifts) {
    const ParamRule& rule = *ckpt.layers[d.layer_index].tensors[d.tensor_index].rule;
    if (PolicyFor(rule, policy) == ReplicatedPolicy::kCheck) {
      if (worst_checked == nullptr) worst_checked = &d;
      ++checked;
    } else {
      ++merged;
    }
  }
  if (checked > 0) {
    return Status::InvalidInput(
        std::to_string(checked) + " replicated tensor(s) differ across TP ranks (largest: " +
        DescribeDrift(ckpt, *worst_checked) +
        "); choose --replicated average (mean of the copies) or --replicated first (TP rank 0's "
        "copy), or see them all with `reshard lint`");
  }
  if (merged > 0) {
    notes->push_back("replicated: " + std::to_string(merged) +
                     " tensor(s) differed across TP ranks and were merged by their policy "
                     "(largest: " + DescribeDrift(ckpt, drifts.front()) + ")");
  }
  return Status::Ok();
}

Status CheckStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt, ReplicatedPolicy policy) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDrift> drifts, MeasureStateDrift(ckpt, opt));
  for (const StateDrift& d : drifts) {
    if (PolicyFor(*d.rule, policy) != ReplicatedPolicy::kCheck) continue;
    return Status::InvalidInput(
        "the optimizer state '" + d.state + "' of replicated parameter " + d.name +
        " differs between TP ranks 0 and " + std::to_string(d.rank) +
        "; choose --replicated average (mean of the copies) or --replicated first (TP rank 0's)");
  }
  return Status::Ok();
}

}  // namespace reshard
