// A DeepSpeed MoE save as a SourceCheckpoint: lint, inspect and the
// weights verify compares. Converting it is not done yet: Plan refuses.

#include "formats/deepspeed/deepspeed_source.h"
#include "formats/deepspeed/drift_lint.h"
#include "formats/deepspeed/moe_reader.h"
#include "formats/deepspeed/state_tensor.h"
#include "logical/drift.h"
#include "plan/tensor_plan.h"

namespace reshard {
namespace {

class MoeSource : public DeepSpeedModelSource {
 public:
  MoeSource(MoeModel moe, const CommonOptions& options)
      : DeepSpeedModelSource(std::move(moe.model), options), pipeline_names_(moe.pipeline_names),
        layout_(std::move(moe.layout)) {}

  std::string kind() const override { return "MoE"; }
  int64_t vocab_rows() const override { return ckpt().vocab.padded_rows; }
  std::optional<int64_t> vocab_size() const override { return ckpt().vocab.original_size; }

  std::string Summary() const override {
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
    if (ckpt().HasErrors()) return;
    ReportDrift(ckpt(), options, report);
    report->findings.push_back({Finding::Severity::kInfo, "MoE: " + layout_.Summary()});
    report->findings.push_back({Finding::Severity::kError, NotYet()});
  }

  std::string Describe() const override {
    return MetadataLines(ckpt()) + layout_.Describe() + "tensors (full logical shapes):\n" + TensorLines(ckpt());
  }

  Result<std::unique_ptr<TargetPlan>> Plan(const ConvertOptions&, std::vector<std::string>*) const override {
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    return Status::Unsupported(NotYet());
  }

  // The weights (experts under their global ids); the optimizer state is
  // not compared yet.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy replicated,
                                              std::atomic<int64_t>* read) const override {
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    std::vector<FullTensor> out;
    const LogicalCheckpoint& c = ckpt();
    for (size_t li = 0; li < c.layers.size(); ++li) {
      for (size_t ti = 0; ti < c.layers[li].tensors.size(); ++ti) {
        const LogicalTensor& t = c.layers[li].tensors[ti];
        const TensorPlan plan = PlanFullTensor(c, static_cast<int>(li), static_cast<int>(ti), replicated);
        RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(c, nullptr, t, plan, read));
        out.push_back({"weights", t.name, t.name, "", t.label, c.WeightDType(t), t.full_shape,
                       t.rule->policy == ParamRule::Policy::kVocab, std::move(produce)});
      }
    }
    return out;
  }

  std::vector<std::string> VerifyNotes() const override {
    std::vector<std::string> notes;
    for (const Drift& d : MeasureDrift(ckpt())) notes.push_back("replicas differ: " + DescribeDrift(ckpt(), d));
    if (HasOptimizerState()) notes.push_back("MoE: the optimizer state is not compared yet; the weights are");
    return notes;
  }

 private:
  static std::string NotYet() {
    return "converting DeepSpeed MoE checkpoints (expert files) is not implemented yet; lint, inspect and "
           "verify read them";
  }

  bool pipeline_names_;
  MoeLayout layout_;
};

}  // namespace

Result<std::unique_ptr<SourceCheckpoint>> OpenMoeSource(CheckpointFiles files, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(MoeModel moe, ReadMoeModel(std::move(files), options));
  return std::unique_ptr<SourceCheckpoint>(new MoeSource(std::move(moe), options));
}

}  // namespace reshard
