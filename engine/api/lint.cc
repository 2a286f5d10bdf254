// reshard::Lint: everything `convert` would object to, without writing.
#include "api/common.h"
#include "logical/drift.h"
#include "formats/deepspeed/zero_shard_reader.h"
#include "formats/deepspeed/state_tensor.h"
#include "formats/deepspeed/zero3_checkpoint.h"
#include "plan/plan.h"
#include "formats/deepspeed/stages.h"

namespace reshard {
namespace {

void Warn(LintReport* report, std::string message) {
  report->findings.push_back({Finding::Severity::kWarning, std::move(message)});
}

void ReportDrift(const LogicalCheckpoint& ckpt, int max_lines, LintReport* report) {
  const std::vector<Drift> drifts = MeasureDrift(ckpt);
  if (drifts.empty()) return;
  Warn(report, std::to_string(drifts.size()) +
                   " replicated tensor(s) differ across TP ranks; convert refuses them unless "
                   "you choose --replicated average (mean) or --replicated first (TP rank 0)");
  for (size_t i = 0; i < drifts.size() && static_cast<int>(i) < max_lines; ++i) {
    Warn(report, "drift: " + DescribeDrift(ckpt, drifts[i]));
  }
  if (static_cast<int>(drifts.size()) > max_lines) {
    Warn(report, "drift: ... and " + std::to_string(drifts.size() - max_lines) + " more");
  }
}

// Replicated parameters whose masters or moments differ across TP ranks:
// convert refuses them under `check`, as it refuses drifted weights.
void ReportStateDrift(const LogicalCheckpoint& ckpt, const SourceOptimizer& opt, int max_lines,
                      LintReport* report) {
  Result<std::vector<StateDrift>> drifts = MeasureStateDrift(ckpt, opt);
  if (!drifts.ok()) {
    report->findings.push_back({Finding::Severity::kError, "optimizer: " + drifts.status().message()});
    return;
  }
  if (drifts->empty()) return;
  Warn(report, std::to_string(drifts->size()) +
                   " optimizer state(s) of replicated parameters differ across TP ranks; convert "
                   "refuses them unless you choose --replicated average or --replicated first");
  for (size_t i = 0; i < drifts->size() && static_cast<int>(i) < max_lines; ++i) {
    const StateDrift& d = (*drifts)[i];
    Warn(report, "optimizer drift: '" + d.state + "' of " + d.name + " differs between TP ranks 0 and " +
                     std::to_string(d.rank));
  }
  if (static_cast<int>(drifts->size()) > max_lines) {
    Warn(report, "optimizer drift: ... and " + std::to_string(drifts->size() - max_lines) + " more");
  }
}

// Reads the optimizer shards the way convert would: their flat layout must
// agree with param_shapes (and param_slice_mappings where present).
void ReportOptimizerState(const LogicalCheckpoint& ckpt, const LintOptions& options,
                          LintReport* report) {
  const Value* embedded = Find(ckpt.metadata[0], "optimizer");
  const size_t shards = ckpt.files.optimizer_files.size();
  // Without pipelining, the FP16_Optimizer state is carried whole.
  if (shards == 0 && (embedded == nullptr || embedded->is_none() || !ckpt.pipeline)) return;
  Result<std::unique_ptr<SourceOptimizer>> opt = SourceOptimizer::Load(ckpt, options.allowed_classes);
  if (!opt.ok()) {
    report->findings.push_back({Finding::Severity::kError, "optimizer: " + opt.status().message()});
    return;
  }
  const OptimizerFormat& f = (*opt)->format();
  std::string states;
  for (const std::string& s : (*opt)->states()) states += (states.empty() ? "" : ", ") + s;
  const std::string where = f.embedded ? std::string("FP16_Optimizer state in the mp_rank files (")
                                       : std::to_string(shards) + " shards (" +
                                             (f.zero ? "ZeRO-1/2" : "BF16 optimizer") + ", ";
  report->findings.push_back(
      {Finding::Severity::kInfo,
       "optimizer: " + where + std::to_string((*opt)->num_groups()) +
           " groups, states " + states +
           (f.slice_mappings || f.embedded ? "" : ", no param_slice_mappings") + "); " +
           (f.embedded ? "its groups agree with DeepSpeed's stage partition"
                       : "their layout agrees with param_shapes")});
  if (ckpt.pipeline) ReportStateDrift(ckpt, **opt, options.max_drift_lines, report);
}

std::string FirstDifference(const std::vector<std::vector<ParamShape>>& recorded,
                            const std::vector<std::vector<ParamShape>>& computed) {
  if (recorded.size() != computed.size()) {
    return std::to_string(recorded.size()) + " groups recorded, " +
           std::to_string(computed.size()) + " computed";
  }
  for (size_t g = 0; g < recorded.size(); ++g) {
    for (size_t i = 0; i < std::max(recorded[g].size(), computed[g].size()); ++i) {
      const std::string r = i < recorded[g].size() ? recorded[g][i].first : "(nothing)";
      const std::string c = i < computed[g].size() ? computed[g][i].first : "(nothing)";
      if (r != c || (i < recorded[g].size() && recorded[g][i].second != computed[g][i].second)) {
        return "group " + std::to_string(g) + " entry " + std::to_string(i) + ": recorded " + r +
               ", computed " + c;
      }
    }
  }
  return "";
}

// Recomputes every source stage's param_shapes with the rule set and
// DeepSpeed's current partition algorithm; a difference means convert's
// stage layout or optimizer groups would not match what wrote the source.
void CheckStages(const LogicalCheckpoint& ckpt, LintReport* report) {
  Result<std::vector<int>> bounds =
      TargetStageBounds(ckpt, ckpt.pp, ckpt.tp, ckpt.vocab.padded_rows, {});
  if (!bounds.ok()) {
    Warn(report, "source stages: " + bounds.status().message());
    return;
  }
  for (int p = 0; p < ckpt.pp; ++p) {
    std::vector<std::vector<ParamShape>> recorded;
    if (!ReadParamShapes(ckpt.metadata[p * ckpt.tp], &recorded)) continue;
    const StageParameters computed =
        StageParams(ckpt, (*bounds)[p], (*bounds)[p + 1], ckpt.tp, ckpt.vocab.padded_rows);
    const std::string diff = FirstDifference(recorded, computed.groups);
    if (!diff.empty()) {
      Warn(report, "param_shapes of pipeline stage " + std::to_string(p) +
                       " differ from what rule set '" + ckpt.rules->name() +
                       "' and DeepSpeed's current partition algorithm give (" + diff +
                       "); converted stages follow the current algorithm unless you pass "
                       "--layers-per-stage");
      return;
    }
  }
}

}  // namespace

bool LintReport::ok() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return false;
  }
  return true;
}

Result<LintReport> Lint(const std::string& checkpoint, const LintOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(checkpoint));
  if (files.IsZero3()) {
    // Loading checks every partition and sub-group against param_shapes.
    RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<Zero3Checkpoint> zero3,
                             Zero3Checkpoint::Load(files, options.allowed_classes));
    LintReport report;
    report.summary = zero3->Summary();
    report.findings.push_back({Finding::Severity::kInfo,
                               "optimizer: the ZeRO-3 partitions agree with param_shapes"});
    return report;
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> ckpt,
                           LoadForCommand(std::move(files), options));
  LintReport report;
  if (ckpt->pipeline) report.rule_set = ckpt->rules->name();
  report.summary = LayoutSummary(*ckpt);
  report.findings = ckpt->findings;
  if (!ckpt->HasErrors() && ckpt->pipeline) {
    ReportDrift(*ckpt, options.max_drift_lines, &report);
    CheckStages(*ckpt, &report);
  }
  if (!ckpt->HasErrors()) ReportOptimizerState(*ckpt, options, &report);
  return report;
}

}  // namespace reshard
