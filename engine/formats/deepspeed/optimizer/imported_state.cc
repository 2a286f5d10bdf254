#include "formats/deepspeed/optimizer/imported_state.h"

#include <algorithm>
#include <map>

#include "formats/deepspeed/files/known_classes.h"
#include "formats/deepspeed/model/stages.h"

namespace reshard {
namespace {

// The DeepSpeed release whose shard layout the template follows (its
// group_paddings and param_slice_mappings): a loader checks the version
// before it reads the shards.
constexpr char kDsVersion[] = "0.14.0";
constexpr char kStep[] = "step";
constexpr double kMegatronClipGrad = 1.0;  // Megatron-LM's --clip-grad default

bool ArgIs(const LogicalCheckpoint& ckpt, const char* flag) {
  const Value* v = Find(ckpt.args(), flag);
  return v != nullptr && v->is(Value::Kind::kBool) && v->as_bool();
}

class ImportedStateOptimizer : public SourceOptimizer {
 public:
  const OptimizerFormat& format() const override { return format_; }
  const std::vector<std::string>& states() const override { return states_; }
  const std::vector<std::string>& scalar_states() const override { return scalars_; }
  int num_groups() const override { return static_cast<int>(groups_); }
  int tp() const override { return 1; }
  const Value& Template() const override { return template_; }
  std::vector<std::string> ParamNames() const override {
    std::vector<std::string> names;
    for (const auto& [name, p] : params_) names.push_back(name);
    return names;
  }
  bool Has(const std::string& name) const override { return params_.count(name) > 0; }
  Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const override {
    auto it = params_.find(name);
    const auto s = std::find(states_.begin(), states_.end(), state);
    if (it == params_.end() || t != 0 || s == states_.end()) {
      return Status::InvalidInput("the imported optimizer state has no " + state + " of " + name);
    }
    return s == states_.begin() ? it->second.master : it->second.moments[s - states_.begin() - 1];
  }

  Status Read(ImportedOptimizer imported, const LogicalCheckpoint& ckpt) {
    if (!imported.masters()) {
      return Status::Unsupported("the optimizer state holds no fp32 masters (" + imported.what + "), which "
                                 "DeepSpeed's optimizer shards keep; pass --weights-only to convert the weights");
    }
    if (ArgIs(ckpt, "fp16")) {
      return Status::Unsupported("torch_dist: fp16 weights: Megatron-Core's loss scaler is not carried into "
                                 "DeepSpeed's shards; pass --weights-only to convert the weights");
    }
    format_.zero = !ArgIs(ckpt, "bf16");
    format_.bf16_prefix = !format_.zero;
    format_.slice_mappings = true;
    states_ = {kMasterState};
    states_.insert(states_.end(), imported.moments.begin(), imported.moments.end());
    RESHARD_RETURN_IF_ERROR(PlaceParams(std::move(imported.params), ckpt));
    groups_ = imported.param_groups.size();
    MakeTemplate(imported, ckpt);
    return Status::Ok();
  }

 private:
  // Under DeepSpeed's parameter names; every weight has its state.
  Status PlaceParams(std::map<std::string, ImportedOptimizer::Param> by_name, const LogicalCheckpoint& ckpt) {
    for (size_t li = 0; li < ckpt.layers.size(); ++li) {
      for (size_t ti = 0; ti < ckpt.layers[li].tensors.size(); ++ti) {
        const LogicalTensor& t = ckpt.layers[li].tensors[ti];
        if (t.rule->buffer) continue;
        auto it = by_name.find(t.name);
        if (it == by_name.end()) {
          return Status::InvalidInput("torch_dist: the optimizer holds no state of " + t.name +
                                      "; pass --weights-only to convert the weights");
        }
        params_.emplace(ParamName(ckpt, static_cast<int>(li), static_cast<int>(ti)), std::move(it->second));
      }
    }
    return Status::Ok();
  }

  // The template every target shard is built from (zero_shard_writer.h
  // fills in the partitions), with the fields of the format in the order
  // DeepSpeed writes them.
  void MakeTemplate(const ImportedOptimizer& imported, const LogicalCheckpoint& ckpt) {
    Items per_group;
    std::vector<Value> groups;
    for (size_t g = 0; g < groups_; ++g) {
      Items state;
      if (imported.step) state.emplace_back(Value::String(kStep), *imported.step);
      for (const std::string& moment : imported.moments) state.emplace_back(Value::String(moment), Value::None());
      per_group.emplace_back(Value::Int(static_cast<int64_t>(g)), Value::MakeDict(std::move(state)));
      // torch's Adam keeps the step in each parameter's state, DeepSpeed's
      // FusedAdam (which Megatron-DeepSpeed trains with) in its group: each
      // group keeps the step it records, else the source's. The group lists
      // its one flat parameter.
      Value group = imported.param_groups[g];
      if (Find(group, kStep) == nullptr && imported.step) Set(group, kStep, *imported.step);
      Set(group, "params", Value::MakeList({Value::Int(static_cast<int64_t>(g))}));
      groups.push_back(std::move(group));
    }
    const Value* clip = Find(ckpt.args(), "clip_grad");
    Value osd = Value::MakeDict();
    if (format_.zero) {
      Set(osd, "loss_scaler", StaticLossScaler(1.0));
      Set(osd, "dynamic_loss_scale", Value::Bool(false));
      Set(osd, "overflow", Value::Bool(false));
    }
    Set(osd, "clip_grad", clip != nullptr ? *clip : Value::Float(kMegatronClipGrad));
    Set(osd, "base_optimizer_state",
        Value::MakeDict({{Value::String("state"), Value::MakeDict(std::move(per_group))},
                         {Value::String("param_groups"), Value::MakeList(std::move(groups))}}));
    Set(osd, "single_partition_of_fp32_groups", Value::MakeList({}));
    if (format_.zero) Set(osd, "zero_stage", ZeroStage(1));
    Set(osd, format_.padding_key, Value::MakeList({}));
    Set(osd, "partition_count", Value::MakeList({}));
    Set(osd, "ds_version", Value::String(kDsVersion));
    const auto& [first, p] = *params_.begin();
    Set(osd, "param_slice_mappings",
        Value::MakeList({MakeOrderedDict({{Value::String(first), FragmentAddress(p.master.numel(), 0)}})}));
    template_ = Value::MakeDict({{Value::String("optimizer_state_dict"), std::move(osd)},
                                 {Value::String("ds_version"), Value::String(kDsVersion)}});
  }

  OptimizerFormat format_;
  std::vector<std::string> states_, scalars_;
  size_t groups_ = 0;
  Value template_;
  std::map<std::string, ImportedOptimizer::Param> params_;  // by DeepSpeed's parameter name
};

}  // namespace

Result<std::unique_ptr<SourceOptimizer>> MakeImportedOptimizer(ImportedOptimizer imported,
                                                               const LogicalCheckpoint& ckpt,
                                                               std::vector<std::string>* notes) {
  auto opt = std::make_unique<ImportedStateOptimizer>();
  const bool clip_recorded = Find(ckpt.args(), "clip_grad") != nullptr;
  RESHARD_RETURN_IF_ERROR(opt->Read(std::move(imported), ckpt));
  notes->push_back(std::string("optimizer: written as ") +
                   (opt->format().zero ? "DeepSpeedZeroOptimizer ZeRO-1 shards (fp32 weights)"
                                       : "BF16_Optimizer shards (bf16 weights)") +
                   ", the source's param groups and step carried" +
                   (clip_recorded ? "" : "; clip_grad 1.0 (Megatron's default: the args do not record it)"));
  return std::unique_ptr<SourceOptimizer>(std::move(opt));
}

}  // namespace reshard
