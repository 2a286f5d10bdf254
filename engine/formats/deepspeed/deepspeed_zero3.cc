// A ZeRO-3 checkpoint as a SourceCheckpoint: its model layout stays, DP changes.
#include "formats/deepspeed/deepspeed_source.h"
#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/universal/universal_writer.h"
#include "formats/deepspeed/zero3/zero3_checkpoint.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "logical/settings.h"
#include "plan/materialize.h"
#include "util/human.h"

namespace reshard {
namespace {

constexpr char kWeightsOnlyRefusal[] =
    "a ZeRO-3 checkpoint keeps its weights in the optimizer shards (fp32 masters); --weights-only does not apply";

class Zero3Source : public SourceCheckpoint {
 public:
  Zero3Source(CheckpointFiles files, std::unique_ptr<Zero3Checkpoint> ckpt, bool weights_only)
      : files_(std::move(files)), ckpt_(std::move(ckpt)), weights_only_(weights_only) {
    info_.kind = "ZeRO-3";
    info_.tag_dir = files_.tag_dir;
    info_.files = files_.Paths();
    info_.iteration = ckpt_->iteration();
    info_.summary = ckpt_->Summary();
    info_.metadata = ckpt_->ranks()[0].model_states[0];
    info_.tp = ckpt_->mp();
    info_.pp = 1;
  }

  // Loading checked every partition and sub-group against param_shapes.
  void Lint(const LintOptions&, LintReport* report) const override {
    report->findings.push_back({Finding::Severity::kInfo,
                                "optimizer: the ZeRO-3 partitions agree with param_shapes"});
  }

  std::string Describe() const override {
    std::string out;
    for (size_t sg = 0; sg < ckpt_->ranks()[0].sub_groups.size(); ++sg) {
      out += "  sub-group " + std::to_string(sg) + ":";
      for (const Zero3Param& p : ckpt_->ranks()[0].sub_groups[sg]) out += " " + p.name + ShapeString(p.shape);
      out += "\n";
    }
    return out;
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>*) const override {
    if (options.target_tp != ckpt_->mp() || options.target_pp != 1 ||
        !options.layers_per_stage.empty()) {
      return Status::InvalidInput("a ZeRO-3 checkpoint keeps its model layout; pass --tp " +
                                  std::to_string(ckpt_->mp()) + " --pp 1 and choose the new --dp");
    }
    if (options.weights_only) {
      return Status::InvalidInput(kWeightsOnlyRefusal);
    }
    const int dp = options.target_dp > 0 ? options.target_dp : ckpt_->dp();
    const bool bf16 = !files_.optimizer_files.empty() && files_.optimizer_files[0].bf16;
    OutputPlan plan;
    plan.summary = ckpt_->Summary() + "\ntarget: DP " + std::to_string(dp) + "\n";
    RESHARD_ASSIGN_OR_RETURN(plan.files, ckpt_->Files(dp, bf16, plan.read.get()));
    plan.publication = NativePublication(files_, ckpt_->iteration(), options.update_latest);
    return plan;
  }

  Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options,
                                                       std::vector<std::string>* notes) const override {
    if (options.weights_only) {
      return Status::InvalidInput(kWeightsOnlyRefusal);
    }
    return PlanUniversalZero3(*ckpt_, files_, notes);
  }

  // Every element of every state of every parameter.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy,
                                              std::atomic<int64_t>* read) const override {
    if (weights_only_) return Status::InvalidInput(kWeightsOnlyRefusal);
    std::vector<FullTensor> out;
    for (int mp = 0; mp < ckpt_->mp(); ++mp) {
      for (const auto& group : ckpt_->ranks()[mp].sub_groups) {
        for (const Zero3Param& p : group) {
          for (const std::string& state : ckpt_->states()) {
            RESHARD_ASSIGN_OR_RETURN(SourceShard shard, ckpt_->Locate(mp, p.name, state));
            SourceTensor source{DType::kFloat32, {std::move(shard)}};
            out.push_back({"optimizer", StateName(state, p.name, mp, ckpt_->mp()), p.name, state, "",
                           DType::kFloat32, p.shape, false,
                           RangeProducer(std::move(source), WholeShardPlan(0, p.numel), read)});
          }
        }
      }
    }
    return out;
  }

 private:
  CheckpointFiles files_;
  std::unique_ptr<Zero3Checkpoint> ckpt_;
  const bool weights_only_;  // opened so (CommonOptions::weights_only), which it cannot honour
};

}  // namespace

Result<std::unique_ptr<SourceCheckpoint>> OpenZero3Source(CheckpointFiles files,
                                                          const CommonOptions& options) {
  RESHARD_RETURN_IF_ERROR(RefuseSettings(options.set));
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<Zero3Checkpoint> ckpt,
                           Zero3Checkpoint::Load(files, options.allowed_classes));
  return std::unique_ptr<SourceCheckpoint>(new Zero3Source(std::move(files), std::move(ckpt), options.weights_only));
}

}  // namespace reshard
