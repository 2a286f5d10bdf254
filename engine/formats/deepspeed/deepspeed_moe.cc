// A DeepSpeed MoE save as a SourceCheckpoint: lint, inspect, the tensors
// verify compares (weights and optimizer state, experts by global id), and
// conversions to another PP, EP and DP size (moe_plan.h, written by moe_writer.h).

#include <mutex>

#include "formats/deepspeed/deepspeed_source.h"
#include "formats/deepspeed/optimizer/drift_lint.h"
#include "formats/deepspeed/optimizer/zero_shard_lint.h"
#include "formats/deepspeed/moe/moe_optimizer.h"
#include "formats/deepspeed/moe/moe_plan.h"
#include "formats/deepspeed/moe/moe_writer.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/moe/moe_reader.h"
#include "formats/deepspeed/model/stages.h"
#include "plan/materialize.h"
#include "plan/tensor_plan.h"
#include "util/strings.h"
#include "logical/drift.h"

namespace reshard {
namespace {

class MoeSource : public DeepSpeedModelSource {
 public:
  MoeSource(MoeModel moe, const CommonOptions& options)
      : DeepSpeedModelSource(std::move(moe.model), options), pipeline_names_(moe.pipeline_names),
        layout_(std::move(moe.layout)), allowed_classes_(options.allowed_classes) {
    SetInfo("MoE", SummaryLine(), true);
    info_.has_experts = true;
  }

  std::string SummaryLine() const {
    const LogicalCheckpoint& c = ckpt();
    size_t expert_files = 0;
    for (const auto& [mp, by_layer] : files().expert_files) {
      for (const auto& [m, by_expert] : by_layer) expert_files += by_expert.size();
    }
    std::string s = std::string("DeepSpeed MoE checkpoint (") +
                    (pipeline_names_ ? "pipeline engine" : "nn.Module, no pipeline engine") + "); rule set " +
                    c.rules->name() + " (numbering " + c.numbering + "); TP " + std::to_string(c.tp) + ", PP " +
                    std::to_string(c.pp) + ", DP " + std::to_string(c.dp) + "; ";
    if (!layout_.blocks.empty()) s += layout_.Summary() + "; ";
    return s + "iteration " + std::to_string(c.iteration) + "; " + std::to_string(expert_files) + " expert files, " +
           std::to_string(c.metadata.size()) + " mp_rank files, " + std::to_string(shard_files()) +
           " optimizer shards";
  }

  void Lint(const LintOptions& options, LintReport* report) const override {
    report->rule_set = ckpt().rules->name();
    ReportMissingValues(ckpt(), options, report);
    if (ckpt().HasErrors()) return;
    ReportDrift(ckpt(), options, report);
    report->findings.push_back({Finding::Severity::kInfo, "MoE: " + layout_.Summary()});
    const Result<bool> has_state = HasState();
    if (!has_state.ok()) {
      report->findings.push_back({Finding::Severity::kError, "optimizer: " + has_state.status().message()});
    } else if (*has_state && options.weights_only) {
      report->findings.push_back({Finding::Severity::kInfo, WeightsOnlyNote(StateWhat())});
    } else if (*has_state) {
      Result<const MoeOptimizer*> opt = State();
      report->findings.push_back(opt.ok() ? StateFinding(**opt)
                                          : Finding{Finding::Severity::kError, "optimizer: " + opt.status().message()});
    }
  }

  std::string Describe() const override {
    return MetadataLines(ckpt()) + layout_.Describe() + "tensors (full logical shapes):\n" + TensorLines(ckpt());
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options,
                                           std::vector<std::string>* notes) const override {
    RESHARD_RETURN_IF_ERROR(CheckValuesGiven(ckpt(), options.target_tp, options.vocab_size));
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    const int ep = options.target_ep > 0 ? options.target_ep : layout_.ep;
    const int dp = options.target_dp > 0 ? options.target_dp : ckpt().dp;
    RESHARD_RETURN_IF_ERROR(CheckTarget(options, ep, dp));
    RESHARD_ASSIGN_OR_RETURN(const int64_t padded_vocab,
                             TargetPaddedVocab(ckpt(), options.target_tp, options.vocab_size));
    RESHARD_ASSIGN_OR_RETURN(std::vector<int> bounds, TargetBounds(options, ep, padded_vocab));
    const MoeOptimizer* opt = nullptr;
    RESHARD_ASSIGN_OR_RETURN(const bool has_state, HasState());
    if (has_state && options.weights_only) {
      notes->push_back(WeightsOnlyNote(StateWhat()));
    } else if (has_state) {
      RESHARD_ASSIGN_OR_RETURN(opt, State());
    }
    if (options.dry_run) {
      notes->push_back(kDryRunNote);
    } else if (options.target_tp != ckpt().tp) {  // TP copies are merged or split
      RESHARD_RETURN_IF_ERROR(opt != nullptr ? CheckReplicas(options.replicated, notes)
                                             : CheckWeightDrift(ckpt(), options.replicated, notes));
    }
    RESHARD_ASSIGN_OR_RETURN(MoePlan plan,
                             MakeMoePlan(ckpt(), files(), layout_, opt,
                                         MoeTarget{ep, dp, bounds, options.replicated, options.target_tp, padded_vocab}));
    notes->insert(notes->end(), plan.notes.begin(), plan.notes.end());
    RESHARD_ASSIGN_OR_RETURN(OutputPlan target, MoeOutput(ckpt(), files(), opt, allowed_classes_, plan));
    target.publication = NativePublication(files(), ckpt().iteration, options.update_latest);
    return target;
  }

  Status CheckReplicas(ReplicatedPolicy replicated, std::vector<std::string>* notes) const override {
    RESHARD_RETURN_IF_ERROR(CheckWeightDrift(ckpt(), replicated, notes));
    RESHARD_ASSIGN_OR_RETURN(const bool has_state, HasState());
    if (!has_state || weights_only()) return Status::Ok();
    RESHARD_ASSIGN_OR_RETURN(const MoeOptimizer* opt, State());
    return CheckStateDrift(ckpt(), *opt, replicated);
  }

  // The weights and every optimizer state, experts under their global ids.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy replicated,
                                              std::atomic<int64_t>* read) const override {
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> out, WeightTensors(ckpt(), nullptr, replicated, read));
    RESHARD_ASSIGN_OR_RETURN(const bool has_state, HasState());
    if (!has_state || weights_only()) return out;
    RESHARD_ASSIGN_OR_RETURN(const MoeOptimizer* opt, State());
    RESHARD_RETURN_IF_ERROR(AddStates(*opt, replicated, read, &out));
    return out;
  }

  Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options,
                                                       std::vector<std::string>*) const override {
    return Status::Unsupported("exporting a DeepSpeed MoE checkpoint --to " + options.to +
                               " is not implemented yet; --to consolidated writes its whole tensors "
                               "(experts under their global ids)");
  }

  std::vector<std::string> VerifyNotes() const override { return DriftNotes(); }

 private:
  // Whether the save has optimizer state: shards, or without them a torch
  // state in the expp_rank files.
  Result<bool> HasState() const {
    if (shard_files() > 0) return true;
    return ExppHoldsState(files(), allowed_classes_);
  }

  std::string StateWhat() const {
    return shard_files() > 0 ? OptimizerWhat() : "torch optimizer state of its expp_rank files (a run without ZeRO)";
  }

  Status CheckTpChange(int tp) const {
    for (const LogicalLayer& layer : ckpt().layers) {
      for (const LogicalTensor& t : layer.tensors) RESHARD_RETURN_IF_ERROR(CheckSplittable(t, tp));
    }
    return Status::Ok();
  }

  bool ChangesStages(const DeepSpeedPlanOptions& options) const {
    return options.target_pp != ckpt().pp || !options.layers_per_stage.empty();
  }

  // The target layouts this conversion can write: TP changed where every
  // tensor splits, PP changed only for the pipeline engine (whose stages are
  // spec ranges), EP dividing DP and every MoE layer's experts.
  Status CheckTarget(const DeepSpeedPlanOptions& options, int ep, int dp) const {
    if (options.target_tp != ckpt().tp) RESHARD_RETURN_IF_ERROR(CheckTpChange(options.target_tp));
    if (ChangesStages(options) && !pipeline_names_) {
      return Status::InvalidInput("a DeepSpeed MoE checkpoint saved without the pipeline engine has one stage and "
                                  "no spec ids to cut stages at; keep --pp 1 (EP, DP and expert-DP change)");
    }
    if (ChangesStages(options) && layout_.old_file_form) {
      return Status::Unsupported("changing PP of a MoE checkpoint with old-form expert files (expert_{e}_mp_rank_*) "
                                 "is not implemented; keep --pp " + std::to_string(ckpt().pp));
    }
    if (dp % ep != 0) {
      return Status::InvalidInput("EP " + std::to_string(ep) + " does not divide DP " + std::to_string(dp) +
                                  " (expert-DP is DP / EP); choose --ep and --dp so that it does");
    }
    for (const MoeBlock& b : layout_.blocks) {
      if (b.experts % ep == 0) continue;
      return Status::InvalidInput("EP " + std::to_string(ep) + " does not divide the " + std::to_string(b.experts) +
                                  " experts of the MoE layer in block " + std::to_string(b.block) +
                                  "; choose an --ep that does");
    }
    return Status::Ok();
  }

  // The target stages: the source's when PP is kept, else DeepSpeed's
  // partition at the target EP (or --layers-per-stage).
  Result<std::vector<int>> TargetBounds(const DeepSpeedPlanOptions& options, int ep, int64_t padded_vocab) const {
    if (!ChangesStages(options)) return SourceStageBounds(ckpt());
    return TargetStageBounds(ckpt(), options.target_pp, options.target_tp, padded_vocab, options.layers_per_stage, ep);
  }

  // The optimizer shards, read once, when a command first needs them.
  Result<const MoeOptimizer*> State() const {
    std::call_once(state_once_, [this] {
      Result<std::unique_ptr<MoeOptimizer>> opt = LoadState();
      if (opt.ok()) {
        state_ = std::move(*opt);
      } else {
        state_status_ = opt.status();
      }
    });
    if (!state_status_.ok()) return state_status_;
    return static_cast<const MoeOptimizer*>(state_.get());
  }

  Result<std::unique_ptr<MoeOptimizer>> LoadState() const {
    if (shard_files() > 0) return MoeOptimizer::Load(ckpt(), files(), layout_, allowed_classes_);
    RESHARD_ASSIGN_OR_RETURN(std::vector<int> bounds, SourceStageBounds(ckpt()));
    return MoeOptimizer::LoadTorch(ckpt(), files(), layout_, bounds, allowed_classes_);
  }

  Finding StateFinding(const MoeOptimizer& opt) const {
    if (opt.format().per_parameter) {
      return {Finding::Severity::kInfo,
              "optimizer: torch optimizer without ZeRO in " + std::to_string(layout_.ep) + " expp_rank files per "
              "stage (" + std::to_string(opt.num_groups()) + " groups on mp_rank_00, states " +
              Join(opt.states(), ", ") + (opt.scalar_states().empty() ? "" : "; scalar " + Join(opt.scalar_states(), ", ")) +
              "); every parameter's state found, experts by their global ids"};
    }
    return {Finding::Severity::kInfo,
            "optimizer: " + std::to_string(shard_files()) + " shards (" + (opt.format().zero ? "ZeRO-1/2" : "BF16 optimizer") +
                ", " + std::to_string(opt.num_groups()) + " groups on mp_rank_00, expert groups over expert-DP " +
                std::to_string(layout_.edp) + ", states " + Join(opt.states(), ", ") +
                "); every parameter's fragments found, experts by their global ids"};
  }

  // Every per-element state of every parameter, whole (TP replicas merged by
  // `replicated` like the weights).
  Status AddStates(const MoeOptimizer& opt, ReplicatedPolicy replicated, std::atomic<int64_t>* read,
                   std::vector<FullTensor>* out) const {
    const LogicalCheckpoint& c = ckpt();
    for (size_t li = 0; li < c.layers.size(); ++li) {
      for (size_t ti = 0; ti < c.layers[li].tensors.size(); ++ti) {
        const LogicalTensor& weight = c.layers[li].tensors[ti];
        if (weight.rule->buffer) continue;
        const std::string saved = MoeSaveName(c.layers[li], weight);
        for (const std::string& state : opt.states()) {
          LogicalTensor st = weight;
          st.dtype = DType::kFloat32;
          for (int t = 0; t < c.tp; ++t) {
            RESHARD_ASSIGN_OR_RETURN(st.shards[t], opt.Locate(saved, t, state));
          }
          const TensorPlan plan = PlanFullTensor(c, static_cast<int>(li), static_cast<int>(ti), replicated);
          out->push_back({"optimizer", "optimizer " + state + " " + weight.name, weight.name, state,
                          "optimizer " + state + " " + saved, DType::kFloat32, weight.full_shape,
                          weight.rule->policy == ParamRule::Policy::kVocab,
                          RangeProducer(SourceTensor::Of(st), plan, read)});
        }
      }
    }
    return Status::Ok();
  }

  bool pipeline_names_;
  MoeLayout layout_;
  std::set<std::string> allowed_classes_;
  mutable std::once_flag state_once_;
  mutable std::unique_ptr<MoeOptimizer> state_;
  mutable Status state_status_;
};

}  // namespace

Result<std::unique_ptr<SourceCheckpoint>> OpenMoeSource(CheckpointFiles files, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(MoeModel moe, ReadMoeModel(std::move(files), options));
  return std::unique_ptr<SourceCheckpoint>(new MoeSource(std::move(moe), options));
}

}  // namespace reshard
