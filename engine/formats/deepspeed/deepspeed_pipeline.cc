// A Megatron-DeepSpeed pipeline checkpoint as a SourceCheckpoint: lint,
// inspect, plan a TP / PP / DP change, and the tensors verify compares.

#include "formats/deepspeed/deepspeed_source.h"

#include <filesystem>

#include "formats/deepspeed/optimizer/drift_lint.h"
#include "formats/deepspeed/optimizer/imported_state.h"
#include "formats/deepspeed/optimizer/param_groups.h"
#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/pipeline/model_states_writer.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/pipeline/pipeline_writer.h"
#include "formats/deepspeed/model/stages.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/universal/universal_writer.h"
#include "formats/deepspeed/optimizer/zero_shard_lint.h"
#include "formats/tp_weights.h"
#include "logical/drift.h"
#include "plan/materialize.h"
#include "plan/tensor_plan.h"
#include "util/strings.h"

namespace reshard {
namespace {

void Warn(LintReport* report, std::string message) {
  report->findings.push_back({Finding::Severity::kWarning, std::move(message)});
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

class PipelineSource : public DeepSpeedModelSource {
 public:
  template <typename... Args>
  explicit PipelineSource(Args&&... args) : DeepSpeedModelSource(std::forward<Args>(args)...) {
    SetInfo("pipeline", SummaryLine(), true);
  }

  std::string SummaryLine() const {
    const LogicalCheckpoint& c = ckpt();
    int blocks = 0;
    for (const SpecEntry& s : c.specs) blocks += s.role == "block" ? 1 : 0;
    std::string s = "rule set " + c.rules->name() + " (numbering " + c.numbering + "); ";
    if (model_->universal) {
      s += "universal checkpoint of DP " + std::to_string(c.dp) + "; iteration " + std::to_string(c.iteration) +
           "; " + Count(blocks, "block") + "; " + std::to_string(files().universal_files.size()) +
           " files in zero/, " + std::to_string(c.metadata.size()) + " mp_rank files; weights are the fp32 "
           "masters as " + DTypeName(*c.weights_from_masters);
    } else {
      s += "TP " + std::to_string(c.tp) + ", PP " + std::to_string(c.pp) + ", DP " + std::to_string(c.dp) +
           "; iteration " + std::to_string(c.iteration) + "; " + Count(blocks, "block") + "; " +
           std::to_string(c.layers.size() * c.tp) + " layer files, " + std::to_string(c.metadata.size()) +
           " mp_rank files, " + std::to_string(shard_files()) + " optimizer shards";
    }
    return s + VocabSummary(c.vocab);
  }

  // Every check of the checkpoint that Plan makes before planning, with the
  // same options, for a target at any layout.
  void Lint(const LintOptions& options, LintReport* report) const override {
    report->rule_set = ckpt().rules->name();
    ReportMissingValues(ckpt(), options, report);
    if (ckpt().HasErrors()) return;
    ReportDrift(ckpt(), options, report);
    // A universal checkpoint's param_shapes are those of the checkpoint it
    // was made from. (An imported model is linted by formats/imported/.)
    if (!model_->universal) CheckStages(ckpt(), report);
    if (!HasOptimizerState()) return;
    if (options.weights_only) {
      report->findings.push_back({Finding::Severity::kInfo, WeightsOnlyNote(OptimizerWhat())});
      return;
    }
    Result<const SourceOptimizer*> opt = Optimizer();
    if (!opt.ok()) {
      report->findings.push_back({Finding::Severity::kError, "optimizer: " + opt.status().message()});
      return;
    }
    report->findings.push_back(model_->universal ? UniversalOptimizerFinding(**opt)
                                                 : OptimizerFinding(**opt, shard_files()));
    ReportStateDrift(ckpt(), **opt, options, report);
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>* notes) const override {
    RESHARD_RETURN_IF_ERROR(CheckValuesGiven(ckpt(), options.target_tp, options.vocab_size));
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    const SourceOptimizer* opt = nullptr;
    if (HasOptimizerState()) {
      if (options.weights_only) {
        notes->push_back(WeightsOnlyNote(OptimizerWhat()));
      } else {
        RESHARD_ASSIGN_OR_RETURN(opt, Optimizer());
      }
    }
    if (options.dry_run) {
      // Planning reads metadata only, so it takes seconds at any size.
      notes->push_back(kDryRunNote);
    } else {
      // The optimizer's replicas too, unless it is left out.
      RESHARD_RETURN_IF_ERROR(opt != nullptr ? CheckReplicas(options.replicated, notes)
                                             : CheckWeightDrift(ckpt(), options.replicated, notes));
    }
    RESHARD_ASSIGN_OR_RETURN(DeepSpeedPlan plan, MakePipelinePlan(ckpt(), opt, PlanOptionsFrom(options)));
    notes->insert(notes->end(), plan.notes.begin(), plan.notes.end());
    if (opt != nullptr) {
      notes->insert(notes->end(), model_->imported_optimizer_notes.begin(), model_->imported_optimizer_notes.end());
    }
    if (opt != nullptr && opt->format().per_parameter) {
      notes->push_back("optimizer: the torch optimizer state inside the mp_rank files is "
                       "reshaped with the weights (each parameter's states like the parameter, "
                       "scalar states and group hyperparameters carried; its parameters follow "
                       "DeepSpeed's current stage partition)");
    } else if (opt != nullptr && opt->format().embedded) {
      notes->push_back("optimizer: the FP16_Optimizer state inside the mp_rank files is "
                       "reshaped with the weights (its groups follow DeepSpeed's current "
                       "stage partition)");
    }
    return NativeOutput(ckpt(), opt, plan, files(), ckpt().iteration, options.update_latest);
  }

  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy replicated,
                                              std::atomic<int64_t>* read) const override {
    // A tensor the rules could not describe is not among the layers' tensors.
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, CarriedOptimizer());
    RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> out, WeightTensors(ckpt(), opt, replicated, read));
    if (opt != nullptr) RESHARD_RETURN_IF_ERROR(AddStates(*opt, replicated, read, &out));
    return out;
  }

  Status CheckReplicas(ReplicatedPolicy replicated, std::vector<std::string>* notes) const override {
    RESHARD_RETURN_IF_ERROR(CheckWeightDrift(ckpt(), replicated, notes));
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, CarriedOptimizer());
    return opt == nullptr ? Status::Ok() : CheckStateDrift(ckpt(), *opt, replicated);
  }

  Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options,
                                      std::vector<std::string>* notes) const override {
    if (!HasOptimizerState() || options.weights_only) {
      return NoStateForUniversal("optimizer state");
    }
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, Optimizer());
    RESHARD_ASSIGN_OR_RETURN(OutputPlan out, PlanUniversal(ckpt(), *opt, files(), options.replicated, options.vocab_size, notes));
    if (model_->imported) RESHARD_RETURN_IF_ERROR(AddModelStates(*opt, options.vocab_size, &out));
    return out;
  }

  Result<TpWeights> WeightsForTp(const TpCut& cut, std::vector<std::string>* notes,
                                 std::atomic<int64_t>* read) const override {
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, CarriedOptimizer());
    auto bytes = [&](int li, int ti, const TensorPlan& plan, const std::string& state) -> Result<ByteProducer> {
      if (state.empty()) return WeightProducer(ckpt(), opt, ckpt().layers[li].tensors[ti], plan, read);
      RESHARD_ASSIGN_OR_RETURN(StateTensor st, LocateState(ckpt(), *opt, ParamName(ckpt(), li, ti), state));
      return RangeProducer(SourceTensor::Of(st.tensor), plan, read);
    };
    return CutWeights(ckpt(), cut, opt != nullptr, bytes, notes);
  }

  Result<OptimizerParamGroups> ParamGroupsAndStep() const override {
    if (!HasOptimizerState()) return Status::InvalidInput("the checkpoint has no optimizer state; export with --weights-only");
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, Optimizer());
    return SourceParamGroups(ckpt(), *opt);
  }

  std::vector<std::string> VerifyNotes() const override { return DriftNotes(); }

 private:
  static bool IsVocab(const LogicalTensor& t) { return t.rule->policy == ParamRule::Policy::kVocab; }

  // A model another format read has no mp_rank files for its universal
  // checkpoint to copy: it gets those a conversion at its own layout (TP 1,
  // PP 1, DP 1) writes, the vocabulary padded for TP 1 (`vocab_size`: the
  // true size --vocab-size gives).
  Status AddModelStates(const SourceOptimizer& opt, std::optional<int64_t> vocab_size, OutputPlan* out) const {
    PlanOptions own;
    own.dp = 1;
    own.vocab_size = vocab_size;
    RESHARD_ASSIGN_OR_RETURN(DeepSpeedPlan plan, MakePipelinePlan(ckpt(), &opt, own));
    RESHARD_ASSIGN_OR_RETURN(OutputPlan native, DeepSpeedOutput(ckpt(), &opt, plan));
    for (PlannedFile& f : native.files) {
      if (f.name.rfind("mp_rank_", 0) == 0) out->files.push_back(std::move(f));
    }
    return Status::Ok();
  }

  // Every element of every optimizer state (fp32 masters, moments, ...), per parameter.
  Status AddStates(const SourceOptimizer& opt, ReplicatedPolicy replicated,
                   std::atomic<int64_t>* read, std::vector<FullTensor>* out) const {
    for (const std::string& name : opt.ParamNames()) {
      for (const std::string& state : opt.states()) {
        RESHARD_ASSIGN_OR_RETURN(StateTensor st, LocateState(ckpt(), opt, name, state));
        const TensorPlan plan = PlanFullTensor(ckpt(), st.layer_index, st.tensor_index, replicated);
        out->push_back({"optimizer", "optimizer " + state + " " + st.tensor.name, st.tensor.name,
                        state, "optimizer " + state + " " + name, DType::kFloat32,
                        st.tensor.full_shape, IsVocab(st.tensor),
                        RangeProducer(SourceTensor::Of(st.tensor), plan, read)});
      }
    }
    return Status::Ok();
  }
};

}  // namespace

std::unique_ptr<SourceCheckpoint> MakePipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                     const CommonOptions& options) {
  return std::make_unique<PipelineSource>(std::move(model), options);
}

std::unique_ptr<SourceCheckpoint> MakeImportedSource(ImportedModel imported, const CommonOptions& options) {
  auto model = std::make_unique<DeepSpeedModel>();
  model->files.root_dir = imported.dir;
  model->files.tag_dir = imported.dir;
  model->files.tag = std::filesystem::path(imported.dir).filename().string();
  model->imported = true;
  model->logical = std::move(imported.logical);
  // Everything here reads a pipeline model's metadata as its mp_rank files
  // (inspect, verify, the writer): a model that has none gets a fresh run's.
  for (Value& run : model->logical.metadata) run = FreshRunModelStates(run);
  std::unique_ptr<SourceOptimizer> optimizer;
  Status status = imported.optimizer_status;
  if (imported.optimizer) {
    Result<std::unique_ptr<SourceOptimizer>> opt =
        MakeImportedOptimizer(std::move(*imported.optimizer), model->logical, &model->imported_optimizer_notes);
    if (opt.ok()) {
      optimizer = std::move(*opt);
    } else {
      status = opt.status();
    }
  }
  return std::make_unique<PipelineSource>(std::move(model), std::move(optimizer), std::move(status), options);
}

std::unique_ptr<SourceCheckpoint> MakeUniversalSource(UniversalCheckpoint universal,
                                                      const CommonOptions& options) {
  return std::make_unique<PipelineSource>(std::move(universal), options);
}

}  // namespace reshard
