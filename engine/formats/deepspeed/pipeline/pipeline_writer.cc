#include "formats/deepspeed/pipeline/pipeline_writer.h"

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/pipeline/model_states_writer.h"
#include "formats/deepspeed/pipeline/unchanged_layer_file.h"
#include "formats/deepspeed/pipeline/zero_shard_writer.h"

namespace reshard {
namespace {

Result<Value> LayerFileTree(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                            const LayerFilePlan& file, std::atomic<int64_t>* read) {
  const LogicalLayer& layer = src.layers[file.layer_index];
  Value root = layer.roots[0];  // the source's container type, key order and extras
  for (const TensorPlan& tp : file.tensors) {
    const LogicalTensor& lt = layer.tensors[tp.tensor_index];
    RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(src, opt, lt, tp, read));
    Value tensor = MakeProducedTensor(src.WeightDType(lt), tp.shape, std::move(produce));
    const Tensor& like = Find(root, lt.key)->as_tensor();
    tensor.as_tensor().storage->location = like.storage->location;
    tensor.as_tensor().requires_grad = like.requires_grad;
    tensor.as_tensor().extra_args = like.extra_args;
    Set(root, lt.key, std::move(tensor));
  }
  return root;
}

// The stage of the target owning spec `id`.
int StageOf(const std::vector<int>& stage_bounds, int id) {
  int stage = 0;
  while (stage + 2 < static_cast<int>(stage_bounds.size()) && id >= stage_bounds[stage + 1]) ++stage;
  return stage;
}

// "layer_04.": what a rank's state dict prefixes the file's keys with.
std::string LayerPrefix(int id) {
  std::string number = std::to_string(id);
  return "layer_" + std::string(number.size() < 2 ? 2 - number.size() : 0, '0') + number + ".";
}

Result<PlannedFile> LayerFile(const LogicalCheckpoint& src, const SourceOptimizer* opt, const DeepSpeedPlan& plan,
                              const LayerFilePlan& file, std::atomic<int64_t>* read) {
  const LogicalLayer& layer = src.layers[file.layer_index];
  RESHARD_ASSIGN_OR_RETURN(Value root, LayerFileTree(src, opt, file, read));
  RESHARD_ASSIGN_OR_RETURN(PlannedFile f, TorchFile(file.name, layer.role, std::move(root)));
  f.roles.push_back(FileRole{FileRole::Holds::kWeights, file.tp_rank, StageOf(plan.stage_bounds, layer.id), -1, "",
                             LayerPrefix(layer.id)});
  for (const TensorPlan& tp : file.tensors) {
    const LogicalTensor& lt = layer.tensors[tp.tensor_index];
    SetFrom(&f, lt.key, "(" + lt.rule->Describe() + ") " + DescribeSources(tp));
  }
  if (std::optional<SourceFileCopy> same = UnchangedSourceFile(src, file)) {
    CopyWhereSame(&f, std::move(same->path), [holds = std::move(same->holds), read, bytes = f.bytes] {
      if (!holds()) return false;
      *read += bytes;  // the copy reads them
      return true;
    });
  }
  return f;
}

// The mp_rank file of `i`, then its optimizer shards, one per DP rank.
Status AddStageFiles(const SourceOptimizer* opt, const DeepSpeedPlan& plan, size_t i, Value model_states,
                     std::atomic<int64_t>* read, std::vector<PlannedFile>* files) {
  const ModelStatesPlan& ms = plan.model_states[i];
  std::vector<Value> shards;
  if (!plan.optimizer.empty()) {
    RESHARD_ASSIGN_OR_RETURN(shards, BuildOptimizerState(*opt, plan.optimizer[i], plan.dp, read));
  }
  const bool embedded = plan.optimizer_format.embedded && !shards.empty();
  if (embedded) {  // the FP16_Optimizer and torch states live inside the mp_rank files
    Set(model_states, "optimizer", std::move(shards[0]));
    shards.clear();
  }
  RESHARD_ASSIGN_OR_RETURN(PlannedFile model, TorchFile(ms.name, plan.ModelStatesWhat(ms), std::move(model_states)));
  SetUnsaidFrom(&model, "optimizer/", kOptimizerStateFrom);
  SetUnsaidFrom(&model, "", "as " + ModelStatesName(ms.source_mp) + " holds it");
  if (!plan.pipeline) {  // a non-pipeline model's weights are the mp_rank file's `module`
    model.roles.push_back(FileRole{FileRole::Holds::kWeights, ms.tp_rank, ms.pp_rank, -1, "module", ""});
  }
  if (embedded) {
    model.detail = plan.OptimizerDetail(plan.optimizer[i], 0);
    model.roles.push_back(FileRole{FileRole::Holds::kOptimizer, ms.tp_rank, ms.pp_rank, -1, "optimizer", ""});
  }
  files->push_back(std::move(model));
  const int mp = ms.pp_rank * plan.tp + ms.tp_rank;
  for (size_t d = 0; d < shards.size(); ++d) {
    RESHARD_ASSIGN_OR_RETURN(
        PlannedFile shard,
        TorchFile(OptimizerFileName(plan.optimizer_format.bf16_prefix, static_cast<int>(d), mp),
                  "optimizer of " + ModelStatesName(mp) + ", DP rank " + std::to_string(d), std::move(shards[d])));
    shard.detail = plan.OptimizerDetail(plan.optimizer[i], static_cast<int>(d));
    SetUnsaidFrom(&shard, "", kOptimizerStateFrom);
    shard.roles.push_back(FileRole{FileRole::Holds::kOptimizer, ms.tp_rank, ms.pp_rank, static_cast<int>(d), "", ""});
    files->push_back(std::move(shard));
  }
  return Status::Ok();
}

}  // namespace

Result<OutputPlan> DeepSpeedOutput(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                   const DeepSpeedPlan& plan) {
  OutputPlan out;
  out.summary = plan.Summary();
  for (const LayerFilePlan& file : plan.layer_files) {
    RESHARD_ASSIGN_OR_RETURN(PlannedFile f, LayerFile(src, opt, plan, file, out.read.get()));
    out.files.push_back(std::move(f));
  }
  for (size_t i = 0; i < plan.model_states.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(AddStageFiles(opt, plan, i, BuildModelStates(src, plan, plan.model_states[i]),
                                          out.read.get(), &out.files));
  }
  return out;
}

}  // namespace reshard
