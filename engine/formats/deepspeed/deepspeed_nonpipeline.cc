// A non-pipeline DeepSpeed checkpoint (HF Trainer, Accelerate, Lightning,
// Megatron-DeepSpeed --no-pipeline-parallel) as a SourceCheckpoint: the whole
// model sits in each mp_rank file's `module`, and only DP can change.
#include <map>

#include "formats/deepspeed/deepspeed_source.h"
#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/pipeline/pipeline_writer.h"
#include "formats/deepspeed/universal/universal_writer.h"
#include "formats/deepspeed/optimizer/zero_shard_lint.h"
#include "plan/materialize.h"

namespace reshard {
namespace {


// Every tensor of a `module` or an optimizer state, by dotted path (string
// and integer keys, list positions).
void CollectTensors(const Value& v, const std::string& prefix, std::map<std::string, const Tensor*>* out) {
  auto path = [&prefix](const std::string& key) { return prefix.empty() ? key : prefix + "." + key; };
  if (v.is(Value::Kind::kTensor)) {
    (*out)[prefix] = &v.as_tensor();
  } else if (v.is(Value::Kind::kList)) {
    const std::vector<Value>& items = v.as_list().items;
    for (size_t i = 0; i < items.size(); ++i) CollectTensors(items[i], path(std::to_string(i)), out);
  } else if (const Items* items = DictItems(v)) {
    for (const auto& [k, child] : *items) {
      if (k.is(Value::Kind::kString)) CollectTensors(child, path(k.as_string()), out);
      if (k.is(Value::Kind::kInt)) CollectTensors(child, path(std::to_string(k.as_int())), out);
    }
  }
}

// Comparing one stored shard whole.
// One TP rank's shard of `param` (a weight, or its optimizer `state`).
FullTensor WholeShard(std::string name, std::string param, std::string state, DType dtype,
                      std::vector<int64_t> shape, SourceShard shard, std::atomic<int64_t>* read) {
  const int64_t numel = shard.numel();
  SourceTensor source{dtype, {std::move(shard)}};
  std::string section = state.empty() ? "weights" : "optimizer";
  return {std::move(section), std::move(name), std::move(param), std::move(state), "", dtype,
          std::move(shape), false, RangeProducer(std::move(source), WholeShardPlan(0, numel), read)};
}

class NonPipelineSource : public DeepSpeedModelSource {
 public:
  NonPipelineSource(std::unique_ptr<DeepSpeedModel> model, const CommonOptions& options)
      : DeepSpeedModelSource(std::move(model), options) {
    SetInfo("non-pipeline", SummaryLine(), false);
  }

  std::string SummaryLine() const {
    return "non-pipeline DeepSpeed checkpoint (the whole model in mp_rank files; only DP can "
           "change); TP " + std::to_string(ckpt().tp) + ", DP " + std::to_string(ckpt().dp) +
           "; iteration " + std::to_string(ckpt().iteration) + "; " +
           std::to_string(shard_files()) + " optimizer shards";
  }

  // Without pipelining, a state inside the mp_rank files is carried whole:
  // only shard files are read.
  void Lint(const LintOptions&, LintReport* report) const override {
    if (ckpt().HasErrors()) return;
    if (shard_files() == 0) {
      if (HasEmbeddedOptimizerState(ckpt())) report->findings.push_back({Finding::Severity::kInfo, kCarriedNote});
      return;
    }
    Result<const SourceOptimizer*> opt = Optimizer();
    if (!opt.ok()) {
      report->findings.push_back({Finding::Severity::kError, "optimizer: " + opt.status().message()});
      return;
    }
    report->findings.push_back(OptimizerFinding(**opt, shard_files()));
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>* notes) const override {
    RESHARD_RETURN_IF_ERROR(ckpt().FirstError());
    const SourceOptimizer* opt = nullptr;
    if (options.weights_only && HasOptimizerState()) {
      notes->push_back(WeightsOnlyNote(OptimizerWhat()));
    } else if (shard_files() > 0) {
      RESHARD_ASSIGN_OR_RETURN(opt, Optimizer());
    } else if (HasEmbeddedOptimizerState(ckpt())) {
      notes->push_back(kCarriedNote);
    }
    if (options.dry_run) {
      notes->push_back(kDryRunNote);
    }
    RESHARD_ASSIGN_OR_RETURN(DeepSpeedPlan plan,
                             MakeDataParallelPlan(ckpt(), opt, PlanOptionsFrom(options)));
    return NativeOutput(ckpt(), opt, plan, files(), ckpt().iteration, options.update_latest);
  }

  // Modules and optimizer state compare rank by rank: the TP layout is kept.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy,
                                              std::atomic<int64_t>* read) const override {
    std::vector<FullTensor> out;
    for (int t = 0; t < ckpt().tp; ++t) {
      AddWhole("module", "", t, read, &out);
      if (!weights_only() && HasEmbeddedOptimizerState(ckpt())) AddWhole("optimizer", "optimizer", t, read, &out);
    }
    if (shard_files() == 0 || weights_only()) return out;
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, Optimizer());
    for (int t = 0; t < ckpt().tp; ++t) {
      for (const std::string& name : opt->ParamNames()) {
        for (const std::string& state : opt->states()) {
          RESHARD_ASSIGN_OR_RETURN(SourceShard shard, opt->Locate(name, t, state));
          const int64_t numel = shard.numel();
          out.push_back(WholeShard(StateName(state, name, t, ckpt().tp), name, state,
                                   DType::kFloat32, {numel}, std::move(shard), read));
        }
      }
    }
    return out;
  }

  Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options,
                                      std::vector<std::string>* notes) const override {
    if (shard_files() == 0 || options.weights_only) {
      return NoStateForUniversal("optimizer shards");
    }
    RESHARD_ASSIGN_OR_RETURN(const SourceOptimizer* opt, Optimizer());
    return PlanUniversalUnsplit(ckpt(), *opt, files(), notes);
  }

 private:
  // Without ZeRO the optimizer state sits in the mp_rank files: a DP change
  // keeps it as it is.
  static constexpr const char* kCarriedNote =
      "optimizer: the optimizer state inside the mp_rank files is carried unchanged (without "
      "ZeRO it is not partitioned over DP ranks)";

  // Every tensor under `key` of TP rank t's mp_rank file, whole: weights
  // (`state` empty) or optimizer state.
  void AddWhole(const std::string& key, const std::string& state, int t, std::atomic<int64_t>* read,
                std::vector<FullTensor>* out) const {
    const Value* root = Find(ckpt().metadata[t], key);
    if (root == nullptr) return;
    std::map<std::string, const Tensor*> tensors;
    CollectTensors(*root, "", &tensors);
    for (const auto& [name, tensor] : tensors) {
      out->push_back(WholeShard(ModelStatesName(t) + " " + key + "." + name, name, state,
                                tensor->storage->dtype, tensor->sizes,
                                SourceShard::Of(*tensor, ShardCoords{t}), read));
    }
  }
};

}  // namespace

std::unique_ptr<SourceCheckpoint> MakeNonPipelineSource(std::unique_ptr<DeepSpeedModel> model,
                                                        const CommonOptions& options) {
  return std::make_unique<NonPipelineSource>(std::move(model), options);
}

}  // namespace reshard
