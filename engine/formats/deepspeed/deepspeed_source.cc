#include "formats/deepspeed/deepspeed_source.h"

#include <filesystem>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/pipeline/pipeline_writer.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "logical/drift.h"
#include "plan/tensor_plan.h"
#include "util/human.h"

namespace reshard {

namespace {

// A MoE save whose expert files were removed (as users do for tools that
// cannot read them) would read as a model without experts.
Status RefuseStrippedMoe(const DeepSpeedModel& model) {
  const Value* experts = Find(model.logical.metadata[0], "num_experts");
  std::vector<int64_t> counts;
  if (experts == nullptr || !ReadIntSequence(*experts, &counts) || counts.empty()) return Status::Ok();
  return Status::InvalidInput("mp_rank_00 records num_experts " + experts->DebugString(60) + " but " +
                              model.files.tag_dir + " has no layer_*_expert_*_model_states.pt files; put the "
                              "expert files back (reshard reads them), or the conversion would drop every expert");
}

}  // namespace

Result<std::unique_ptr<SourceCheckpoint>> OpenDeepSpeedCheckpoint(CheckpointFiles files,
                                                                  const CommonOptions& options) {
  if (files.IsZero3()) return OpenZero3Source(std::move(files), options);
  if (files.IsMoe()) return OpenMoeSource(std::move(files), options);
  if (files.IsUniversal()) {
    RESHARD_ASSIGN_OR_RETURN(UniversalCheckpoint universal, ReadUniversalCheckpoint(std::move(files), options));
    return MakeUniversalSource(std::move(universal), options);
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<DeepSpeedModel> model,
                           ReadDeepSpeedModel(std::move(files), options));
  RESHARD_RETURN_IF_ERROR(RefuseStrippedMoe(*model));
  if (model->pipeline) return MakePipelineSource(std::move(model), options);
  return MakeNonPipelineSource(std::move(model), options);
}

Publication NativePublication(const CheckpointFiles& files, int64_t iteration, bool update_latest) {
  Publication out;
  if (files.via_root) out.output_subfolder = files.tag;
  if (!update_latest) return out;
  out.root_markers.assign(std::begin(kRootPointers), std::end(kRootPointers));
  namespace fs = std::filesystem;
  for (const std::string& name : files.root_scripts) out.copies.push_back((fs::path(files.root_dir) / name).string());
  std::error_code ec;
  if (fs::exists(fs::path(files.root_dir) / "latest_checkpointed_iteration.txt", ec)) {
    out.pointers.push_back({"latest_checkpointed_iteration.txt", std::to_string(iteration)});
  }
  out.pointers.push_back({"latest", std::nullopt});
  out.protected_folder = files.root_dir;
  out.protected_hint = "whose 'latest' it would replace; choose a folder elsewhere or pass --no-update-latest";
  return out;
}

Result<OutputPlan> NativeOutput(const LogicalCheckpoint& src, const SourceOptimizer* opt, const DeepSpeedPlan& plan,
                                const CheckpointFiles& files, int64_t iteration, bool update_latest) {
  RESHARD_ASSIGN_OR_RETURN(OutputPlan out, DeepSpeedOutput(src, opt, plan));
  out.publication = NativePublication(files, iteration, update_latest);
  return out;
}

void DeepSpeedModelSource::SetInfo(std::string kind, std::string summary, bool vocab) {
  info_.kind = std::move(kind);
  info_.tag_dir = files().tag_dir;
  info_.files = files().Paths();
  info_.iteration = ckpt().iteration;
  info_.summary = std::move(summary);
  info_.findings = ckpt().findings;
  info_.metadata = ckpt().metadata[0];
  info_.rules = ckpt().rules;
  info_.settings = ckpt().settings;
  info_.tp = ckpt().tp;
  info_.pp = ckpt().pp;
  info_.dp = ckpt().dp;
  if (!vocab) return;
  info_.vocab_rows = ckpt().vocab.padded_rows;
  info_.vocab_size = ckpt().vocab.original_size;
  info_.vocab_divisible_by = ckpt().vocab.divisible_by;
}

std::vector<std::string> DeepSpeedModelSource::DriftNotes() const {
  std::vector<std::string> notes;
  for (const Drift& d : MeasureDrift(ckpt())) notes.push_back("replicas differ: " + DescribeDrift(ckpt(), d));
  return notes;
}

const char DeepSpeedModelSource::kDryRunNote[] =
    "dry run: replicated tensors were not compared across TP ranks; `reshard lint` does, and "
    "convert refuses drift it is not told to merge";

bool DeepSpeedModelSource::HasOptimizerState() const {
  return optimizer_read_ || shard_files() > 0 || HasEmbeddedOptimizerState(ckpt());
}

std::string DeepSpeedModelSource::OptimizerWhat() const {
  if (model_->universal) return "optimizer state of its zero/ files";
  if (optimizer_read_) return "optimizer state";
  return shard_files() > 0 ? std::to_string(shard_files()) + " optimizer shard files"
                           : "optimizer state inside its mp_rank files";
}

Result<const SourceOptimizer*> DeepSpeedModelSource::Optimizer() const {
  std::call_once(optimizer_once_, [this] {
    if (optimizer_read_) return;
    Result<std::unique_ptr<SourceOptimizer>> opt =
        ShardOptimizer::Load(ckpt(), model_->files.optimizer_files, allowed_classes_);
    if (opt.ok()) {
      optimizer_ = std::move(*opt);
    } else {
      optimizer_status_ = opt.status();
    }
  });
  if (!optimizer_status_.ok()) return optimizer_status_;
  return static_cast<const SourceOptimizer*>(optimizer_.get());
}

Result<const SourceOptimizer*> DeepSpeedModelSource::CarriedOptimizer() const {
  if (weights_only_ || !HasOptimizerState()) return static_cast<const SourceOptimizer*>(nullptr);
  return Optimizer();
}

Result<std::vector<FullTensor>> WeightTensors(const LogicalCheckpoint& ckpt, const SourceOptimizer* masters,
                                              ReplicatedPolicy replicated, std::atomic<int64_t>* read) {
  std::vector<FullTensor> out;
  for (size_t li = 0; li < ckpt.layers.size(); ++li) {
    for (size_t ti = 0; ti < ckpt.layers[li].tensors.size(); ++ti) {
      const LogicalTensor& t = ckpt.layers[li].tensors[ti];
      const TensorPlan plan = PlanFullTensor(ckpt, static_cast<int>(li), static_cast<int>(ti), replicated);
      RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(ckpt, masters, t, plan, read));
      out.push_back({"weights", t.name, t.name, "", t.label, ckpt.WeightDType(t), t.full_shape,
                     t.rule->policy == ParamRule::Policy::kVocab, std::move(produce)});
    }
  }
  return out;
}

std::string StateName(const std::string& state, const std::string& param, int mp, int mp_ranks) {
  return "optimizer " + state + " " + param + (mp_ranks > 1 ? " on " + ModelStatesName(mp) : "");
}

std::string MetadataLines(const LogicalCheckpoint& ckpt) {
  std::string out = "metadata (mp_rank_00):\n";
  for (const auto& [k, v] : *DictItems(ckpt.metadata[0])) {
    const std::string key = k.is(Value::Kind::kString) ? k.as_string() : k.DebugString();
    if (key == "args") continue;
    out += "  " + key + ": " + v.DebugString(100) + "\n";
  }
  const Items* args = DictItems(ckpt.args());
  if (args == nullptr) return out;
  out += "args (" + std::to_string(args->size()) + " fields):";
  static const char* kLayoutFields[] = {
      "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
      "num_key_value_heads", "kv_channels", "max_position_embeddings", "padded_vocab_size",
      "make_vocab_size_divisible_by", "tensor_model_parallel_size",
      "pipeline_model_parallel_size", "data_parallel_size", "world_size"};
  for (const char* field : kLayoutFields) {
    if (const Value* v = Find(ckpt.args(), field)) out += std::string(" ") + field + "=" + v->DebugString(20);
  }
  return out + "\n";
}

std::string TensorLines(const LogicalCheckpoint& ckpt) {
  std::string out;
  for (const LogicalLayer& layer : ckpt.layers) {
    out += "  " + layer.label + " " + layer.role + " (" + ckpt.specs[layer.id].class_name + ")\n";
    for (const LogicalTensor& t : layer.tensors) {
      out += "    " + t.key + "  " + DTypeName(ckpt.WeightDType(t)) + ShapeString(t.full_shape) + "  " +
             t.rule->Describe() + "  name " + t.name + "\n";
    }
  }
  for (const Finding& f : ckpt.findings) out += "problem: " + f.message + "\n";
  return out;
}

std::vector<MissingValue> DeepSpeedModelSource::MissingValues(std::optional<int> repad_tp,
                                                             std::optional<int64_t> vocab_size) const {
  return reshard::MissingValues(ckpt(), repad_tp, vocab_size);
}

std::string DeepSpeedModelSource::Describe() const {
  return MetadataLines(ckpt()) + "layer files (full logical shapes):\n" + TensorLines(ckpt());
}

}  // namespace reshard
