#include "formats/deepspeed/pipeline/pipeline_writer.h"

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/pipeline/model_states_writer.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/pipeline/zero_shard_writer.h"
#include "formats/file_jobs.h"

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

}  // namespace

Result<std::vector<Job>> DeepSpeedJobs(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                       const DeepSpeedPlan& plan, std::atomic<int64_t>* read) {
  std::vector<Job> jobs;
  for (const LayerFilePlan& file : plan.layer_files) {
    RESHARD_ASSIGN_OR_RETURN(Value root, LayerFileTree(src, opt, file, read));
    RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(file.name, std::move(root)));
    jobs.push_back(std::move(job));
  }
  for (size_t i = 0; i < plan.model_states.size(); ++i) {
    const ModelStatesPlan& ms = plan.model_states[i];
    Value root = BuildModelStates(src, plan, ms);
    std::vector<Value> shards;
    if (!plan.optimizer.empty()) {
      RESHARD_ASSIGN_OR_RETURN(shards, BuildOptimizerState(*opt, plan.optimizer[i], plan.dp, read));
    }
    if (plan.optimizer_format.embedded && !shards.empty()) {
      // The FP16_Optimizer state lives inside the mp_rank files.
      Set(root, "optimizer", std::move(shards[0]));
      shards.clear();
    }
    RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(ms.name, std::move(root)));
    jobs.push_back(std::move(job));
    const int mp = ms.pp_rank * plan.tp + ms.tp_rank;
    for (size_t d = 0; d < shards.size(); ++d) {
      RESHARD_ASSIGN_OR_RETURN(
          Job shard, TorchFileJob(OptimizerFileName(plan.optimizer_format.bf16_prefix,
                                                    static_cast<int>(d), mp),
                                  std::move(shards[d])));
      jobs.push_back(std::move(shard));
    }
  }
  return jobs;
}

}  // namespace reshard
