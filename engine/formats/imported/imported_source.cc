#include "formats/imported/imported_source.h"

#include <algorithm>
#include <mutex>

#include "formats/tp_weights.h"
#include "logical/optimizer_groups.h"
#include "plan/materialize.h"
#include "plan/tensor_plan.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kStep[] = "step";

// Every tensor by its canonical name with its global shape, dtype and TP
// policy, then the problems found: what inspect lists.
std::string TensorLines(const LogicalCheckpoint& ckpt) {
  std::string out;
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      out += "  " + t.name + "  " + DTypeName(ckpt.WeightDType(t)) + ShapeString(t.full_shape) + "  " +
             t.rule->Describe() + "\n";
    }
  }
  for (const Finding& f : ckpt.findings) out += "problem: " + f.message + "\n";
  return out;
}

class ModelSource : public SourceCheckpoint {
 public:
  ModelSource(ImportedModel model, const CommonOptions& options, DeepSpeedLayout deepspeed)
      : model_(std::move(model)), options_(options), deepspeed_(std::move(deepspeed)) {
    if (model_.optimizer) CheckEveryWeightHasState();
    SetInfo();
  }

  void Lint(const LintOptions& options, LintReport* report) const override {
    report->rule_set = ckpt().rules->name();
    ReportMissingValues(ckpt(), options, report);
    if (ckpt().HasErrors() || !HasOptimizerState()) return;
    if (options.weights_only) {
      report->findings.push_back({Finding::Severity::kInfo, WeightsOnlyNote()});
    } else if (!model_.optimizer_status.ok()) {
      report->findings.push_back({Finding::Severity::kError, "optimizer: " + model_.optimizer_status.message()});
    } else {
      const ImportedOptimizer& opt = *model_.optimizer;
      report->findings.push_back({Finding::Severity::kInfo,
                                  "optimizer: read with the model (" + opt.what + "; " +
                                      Count(static_cast<int64_t>(opt.param_groups.size()), "group") + ", states " +
                                      Join(States(opt), ", ") + ")"});
    }
  }

  std::string Describe() const override {
    std::string out = info_.format + ":\n";
    for (const auto& [name, value] : model_.facts) out += "  " + name + ": " + value + "\n";
    return out + "tensors (canonical names, global shapes):\n" + TensorLines(ckpt());
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>* notes) const override {
    return DeepSpeed().Plan(options, notes);
  }

  Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options, std::vector<std::string>* notes) const override {
    return DeepSpeed().PlanFamilyFormat(options, notes);
  }

  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy replicated,
                                              std::atomic<int64_t>* read) const override {
    // A tensor the rules could not describe is not among the layers' tensors.
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    RESHARD_ASSIGN_OR_RETURN(const ImportedOptimizer* opt, CarriedOptimizer());
    std::vector<FullTensor> out;
    ForEachTensor([&](int li, int ti, const LogicalTensor& t) {
      out.push_back({"weights", t.name, t.name, "", t.label, ckpt().WeightDType(t), t.full_shape, IsVocab(t),
                     RangeProducer(SourceTensor::Of(t), PlanFullTensor(ckpt(), li, ti, replicated), read)});
    });
    if (opt == nullptr) return out;
    ForEachTensor([&](int li, int ti, const LogicalTensor& t) {
      if (t.rule->buffer) return;
      for (const std::string& state : States(*opt)) {
        out.push_back({"optimizer", "optimizer " + state + " " + t.name, t.name, state,
                       t.label == t.name ? "" : t.label, StateDType(*opt, state), t.full_shape, IsVocab(t),
                       RangeProducer(StateOf(*opt, t, state), PlanFullTensor(ckpt(), li, ti, replicated), read)});
      }
    });
    return out;
  }

  Result<TpWeights> WeightsForTp(const TpCut& cut, std::vector<std::string>* notes,
                                 std::atomic<int64_t>* read) const override {
    RESHARD_ASSIGN_OR_RETURN(const ImportedOptimizer* opt, CarriedOptimizer());
    if (opt != nullptr && !opt->masters() && !cut.state.empty()) {
      // The targets that cut states by TP (Megatron's) keep fp32 masters and moments.
      return Status::Unsupported("the optimizer state holds no fp32 masters (" + opt->what + "), which this "
                                 "target's optimizer keeps; pass --weights-only to convert the weights");
    }
    auto bytes = [&](int li, int ti, const TensorPlan& plan, const std::string& state) -> Result<ByteProducer> {
      const LogicalTensor& t = ckpt().layers[li].tensors[ti];
      return RangeProducer(state.empty() ? SourceTensor::Of(t) : StateOf(*opt, t, state), plan, read);
    };
    return CutWeights(ckpt(), cut, opt != nullptr, bytes, notes);
  }

  Result<OptimizerParamGroups> ParamGroupsAndStep() const override {
    if (!HasOptimizerState()) return Status::InvalidInput("the checkpoint has no optimizer state; export with --weights-only");
    RESHARD_RETURN_IF_ERROR(model_.optimizer_status);
    const ImportedOptimizer& opt = *model_.optimizer;
    if (opt.param_groups.empty()) {
      return Status::Unsupported("the optimizer state records no param_groups to write the target's from; "
                                 "export with --weights-only");
    }
    std::vector<ParamShape> params;
    ForEachTensor([&](int, int, const LogicalTensor& t) {
      if (!t.rule->buffer) params.push_back({t.name, t.full_shape});
    });
    const std::vector<std::vector<ParamShape>> groups = GroupParams(params, ckpt().rules->optimizer_groups());
    if (groups.size() != opt.param_groups.size()) {
      return Status::Unsupported("the optimizer has " + std::to_string(opt.param_groups.size()) +
                                 " param groups where rule set " + ckpt().rules->name() + "'s optimizer_groups make " +
                                 std::to_string(groups.size()) + "; export with --weights-only");
    }
    OptimizerParamGroups out;
    out.step = opt.step;
    if (!out.step) {
      if (const Value* step = Find(opt.param_groups.front(), kStep)) out.step = *step;
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      if (DictItems(opt.param_groups[g]) == nullptr) {
        return Status::InvalidInput("optimizer param group " + std::to_string(g) +
                                    " is not a dict; export with --weights-only");
      }
      OptimizerParamGroup group;
      group.hyperparameters = GroupHyperparameters(opt.param_groups[g]);
      group.weight_decay_multiplier = GroupDecays(groups[g]) ? 1.0 : 0.0;
      for (const ParamShape& p : groups[g]) group.params.push_back(p.first);
      out.groups.push_back(std::move(group));
    }
    return out;
  }

  std::vector<MissingValue> MissingValues(std::optional<int> repad_tp,
                                          std::optional<int64_t> vocab_size) const override {
    return reshard::MissingValues(ckpt(), repad_tp, vocab_size);
  }

 private:
  const LogicalCheckpoint& ckpt() const { return model_.logical; }

  static bool IsVocab(const LogicalTensor& t) { return t.rule->policy == ParamRule::Policy::kVocab; }

  // Calls fn(layer index, tensor index, tensor) for every tensor, in layer order.
  template <typename Fn>
  void ForEachTensor(Fn fn) const {
    for (size_t li = 0; li < ckpt().layers.size(); ++li) {
      const std::vector<LogicalTensor>& tensors = ckpt().layers[li].tensors;
      for (size_t ti = 0; ti < tensors.size(); ++ti) fn(static_cast<int>(li), static_cast<int>(ti), tensors[ti]);
    }
  }

  // The fp32 master where the run keeps one, then the moments.
  static std::vector<std::string> States(const ImportedOptimizer& opt) {
    std::vector<std::string> states;
    if (opt.masters()) states.push_back(kFp32Master);
    states.insert(states.end(), opt.moments.begin(), opt.moments.end());
    return states;
  }

  static DType StateDType(const ImportedOptimizer& opt, const std::string& state) {
    return state == kFp32Master ? DType::kFloat32 : opt.moments_dtype;
  }

  // Optimizer state `state` of weight `t`, laid out like the weight's one
  // shard (an import is at TP 1). REQUIRES: t has state (CheckEveryWeightHasState).
  static SourceTensor StateOf(const ImportedOptimizer& opt, const LogicalTensor& t, const std::string& state) {
    const ImportedOptimizer::Param& p = opt.params.at(t.name);
    SourceTensor out;
    out.dtype = StateDType(opt, state);
    if (state == kFp32Master) {
      out.shards.push_back(p.master);
    } else {
      const auto it = std::find(opt.moments.begin(), opt.moments.end(), state);
      out.shards.push_back(p.moments.at(static_cast<size_t>(it - opt.moments.begin())));
    }
    return out;
  }

  // An optimizer that lacks a weight's state cannot be carried.
  void CheckEveryWeightHasState() {
    ForEachTensor([this](int, int, const LogicalTensor& t) {
      if (t.rule->buffer || model_.optimizer->params.count(t.name) > 0 || !model_.optimizer_status.ok()) return;
      model_.optimizer_status = Status::InvalidInput(model_.what + ": the optimizer holds no state of " + t.name +
                                                     "; pass --weights-only to convert the weights");
    });
    if (!model_.optimizer_status.ok()) model_.optimizer.reset();
  }

  bool HasOptimizerState() const { return model_.optimizer || !model_.optimizer_status.ok(); }

  // The optimizer state the commands carry: null when there is none or the
  // checkpoint was opened weights-only; an error when it cannot be read.
  Result<const ImportedOptimizer*> CarriedOptimizer() const {
    if (options_.weights_only || !HasOptimizerState()) return static_cast<const ImportedOptimizer*>(nullptr);
    RESHARD_RETURN_IF_ERROR(model_.optimizer_status);
    return &*model_.optimizer;
  }

  std::string WeightsOnlyNote() const {
    return "weights only: the optimizer state (" +
           (model_.optimizer ? model_.optimizer->what : std::string("not read")) + ") is not carried";
  }

  void SetInfo() {
    const LogicalCheckpoint& c = ckpt();
    info_.kind = "model";
    info_.tag_dir = model_.dir;
    info_.files = model_.files;
    info_.iteration = c.iteration;
    info_.summary = SummaryLine();
    info_.findings = c.findings;
    info_.notes = model_.notes;
    info_.metadata = c.metadata[0];
    info_.rules = c.rules;
    info_.settings = c.settings;
    info_.optimizer_layout = model_.optimizer ? model_.optimizer->layout : "";
    info_.format_version = model_.format_version;
    info_.run_state.clear();
    if (model_.records_iteration) info_.run_state.insert(kIterationKey);
    info_.vocab_rows = c.vocab.padded_rows;
    info_.vocab_size = c.vocab.original_size;
    info_.vocab_divisible_by = c.vocab.divisible_by;
  }

  // No layer files' numbering: the model was read in its own format's terms.
  std::string SummaryLine() const {
    const LogicalCheckpoint& c = ckpt();
    int blocks = 0;
    for (const SpecEntry& s : c.specs) blocks += s.role == "block" ? 1 : 0;
    return "rule set " + c.rules->name() + "; " + model_.what + "; " +
           Count(blocks, "block") + (HasOptimizerState() ? "; weights and optimizer state" : "; weights only") +
           VocabSummary(c.vocab);
  }

  // The model in DeepSpeed's layout, made once, when first planned so.
  const SourceCheckpoint& DeepSpeed() const {
    std::call_once(deepspeed_once_, [this] { deepspeed_source_ = deepspeed_(model_, options_); });
    return *deepspeed_source_;
  }

  ImportedModel model_;
  const CommonOptions options_;
  const DeepSpeedLayout deepspeed_;
  mutable std::once_flag deepspeed_once_;
  mutable std::unique_ptr<SourceCheckpoint> deepspeed_source_;
};

}  // namespace

std::unique_ptr<SourceCheckpoint> MakeModelSource(ImportedModel model, const CommonOptions& options,
                                                  DeepSpeedLayout deepspeed) {
  return std::make_unique<ModelSource>(std::move(model), options, std::move(deepspeed));
}

}  // namespace reshard
