#include "exec/model_states.h"

namespace reshard {
namespace {

// Replaces `key` only where the source has it: reshard never adds fields a
// given Megatron or DeepSpeed version did not write.
void ReplaceIfPresent(Value* dict, const std::string& key, Value v) {
  if (dict != nullptr && Find(*dict, key) != nullptr) Set(*dict, key, std::move(v));
}

Value ParamShapesValue(const std::vector<std::vector<ParamShape>>& groups) {
  std::vector<Value> list;
  for (const auto& group : groups) {
    Items items;
    for (const auto& [name, shape] : group) items.emplace_back(Value::String(name), MakeTorchSize(shape));
    list.push_back(MakeOrderedDict(std::move(items)));
  }
  return Value::MakeList(std::move(list));
}

void RewriteArgs(const Plan& plan, Value* args) {
  ReplaceIfPresent(args, "tensor_model_parallel_size", Value::Int(plan.tp));
  ReplaceIfPresent(args, "pipeline_model_parallel_size", Value::Int(plan.pp));
  ReplaceIfPresent(args, "data_parallel_size", Value::Int(plan.dp));
  ReplaceIfPresent(args, "world_size", Value::Int(int64_t{plan.tp} * plan.pp * plan.dp));
  if (plan.padded_vocab > 0) ReplaceIfPresent(args, "padded_vocab_size", Value::Int(plan.padded_vocab));
}

void RewriteVocabInfo(const Plan& plan, Value* root) {
  if (plan.padded_vocab == 0) return;
  for (const char* key : {"checkpoint_info", "universal_checkpoint_info"}) {
    ReplaceIfPresent(FindMutable(*root, key), "padded_vocab_size", Value::Int(plan.padded_vocab));
  }
}

}  // namespace

Value BuildModelStates(const LogicalCheckpoint& src, const Plan& plan, const ModelStatesPlan& ms,
                       bool drop_optimizer) {
  Value root = src.metadata[ms.source_mp];
  ReplaceIfPresent(&root, "mp_world_size", Value::Int(int64_t{plan.tp} * plan.pp));
  ReplaceIfPresent(&root, "dp_world_size", Value::Int(plan.dp));
  const Value* shapes = Find(root, "param_shapes");
  if (shapes != nullptr && !shapes->is_none()) Set(root, "param_shapes", ParamShapesValue(ms.param_shapes));
  const Value* buffers = Find(root, "buffer_names");
  if (buffers != nullptr && buffers->is(Value::Kind::kList)) {
    std::vector<Value> names;
    for (const std::string& b : ms.buffer_names) names.push_back(Value::String(b));
    Set(root, "buffer_names", Value::MakeList(std::move(names)));
  }
  if (drop_optimizer) ReplaceIfPresent(&root, "optimizer", Value::None());
  RewriteArgs(plan, FindMutable(root, "args"));
  RewriteVocabInfo(plan, &root);
  Value* dims = FindMutable(root, "checkpoint_parallel_dimensions");
  ReplaceIfPresent(dims, "tp_degree", Value::Int(plan.tp));
  ReplaceIfPresent(dims, "pp_degree", Value::Int(plan.pp));
  return root;
}

}  // namespace reshard
