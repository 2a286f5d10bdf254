#include "formats/deepspeed/pipeline/model_states_writer.h"

#include <algorithm>
#include <cctype>

#include "formats/deepspeed/model/stages.h"

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

void RewriteArgs(const DeepSpeedPlan& plan, Value* args) {
  ReplaceIfPresent(args, "tensor_model_parallel_size", Value::Int(plan.tp));
  ReplaceIfPresent(args, "pipeline_model_parallel_size", Value::Int(plan.pp));
  ReplaceIfPresent(args, "data_parallel_size", Value::Int(plan.dp));
  ReplaceIfPresent(args, "world_size", Value::Int(int64_t{plan.tp} * plan.pp * plan.dp));
  if (plan.padded_vocab > 0) ReplaceIfPresent(args, "padded_vocab_size", Value::Int(plan.padded_vocab));
}

// A universal-checkpoint pattern for a parameter name, spelled as
// Megatron-DeepSpeed spells them: the spec id becomes \d+ and dots stay
// unescaped ("3.input_layernorm.weight" -> "\d+.input_layernorm.weight").
std::string NamePattern(const std::string& name) {
  size_t digits = 0;
  while (digits < name.size() && std::isdigit(static_cast<unsigned char>(name[digits]))) ++digits;
  return digits > 0 ? "\\d+" + name.substr(digits) : name;
}

void AddPattern(const std::string& pattern, std::vector<Value>* list) {
  for (const Value& v : *list) {
    if (v.as_string() == pattern) return;
  }
  list->push_back(Value::String(pattern));
}

// DeepSpeed's ds_to_universal merges TP slices by these pattern lists, which
// Megatron-DeepSpeed writes only when TP > 1: a target at TP 1 drops them, a
// target with TP > 1 from a TP-1 source (which has none) gets them from the rules.
void RewriteUniversalPatterns(const LogicalCheckpoint& src, const DeepSpeedPlan& plan, Value* info) {
  Items* items = info != nullptr ? MutableDictItems(*info) : nullptr;
  if (items == nullptr) return;
  if (plan.tp == 1) {
    auto tp_only = [](const std::pair<Value, Value>& item) {
      return item.first.is(Value::Kind::kString) &&
             (item.first.as_string() == "tp_replicated_parameter_patterns" ||
              item.first.as_string() == "parameter_with_row_parallelism_patterns");
    };
    items->erase(std::remove_if(items->begin(), items->end(), tp_only), items->end());
    return;
  }
  if (Find(*info, "tp_replicated_parameter_patterns") != nullptr) return;
  std::vector<Value> replicated, row_parallel, two_parts;
  for (size_t li = 0; li < src.layers.size(); ++li) {
    for (size_t ti = 0; ti < src.layers[li].tensors.size(); ++ti) {
      const ParamRule& rule = *src.layers[li].tensors[ti].rule;
      if (rule.buffer) continue;
      const std::string pattern = NamePattern(ParamName(src, static_cast<int>(li), static_cast<int>(ti)));
      if (rule.policy == ParamRule::Policy::kReplicated) AddPattern(pattern, &replicated);
      if (rule.policy == ParamRule::Policy::kSplit && rule.dim == 1) AddPattern(pattern, &row_parallel);
      if (rule.policy == ParamRule::Policy::kSplit && rule.parts == 2) AddPattern(pattern, &two_parts);
    }
  }
  auto add_absent = [info](const char* key, std::vector<Value> list) {
    if (!list.empty() && Find(*info, key) == nullptr) Set(*info, key, Value::MakeList(std::move(list)));
  };
  add_absent("tp_replicated_parameter_patterns", std::move(replicated));
  add_absent("parameter_with_row_parallelism_patterns", std::move(row_parallel));
  add_absent("parameter_with_2_sub_params_cat_dim_0", std::move(two_parts));
}

void RewriteVocabInfo(const DeepSpeedPlan& plan, Value* root) {
  if (plan.padded_vocab == 0) return;
  for (const char* key : {"checkpoint_info", "universal_checkpoint_info"}) {
    ReplaceIfPresent(FindMutable(*root, key), "padded_vocab_size", Value::Int(plan.padded_vocab));
  }
}

}  // namespace

Value BuildModelStates(const LogicalCheckpoint& src, const DeepSpeedPlan& plan,
                       const ModelStatesPlan& ms) {
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
  if (plan.drop_embedded_optimizer) ReplaceIfPresent(&root, "optimizer", Value::None());
  RewriteArgs(plan, FindMutable(root, "args"));
  RewriteVocabInfo(plan, &root);
  if (plan.pipeline) RewriteUniversalPatterns(src, plan, FindMutable(root, "universal_checkpoint_info"));
  Value* dims = FindMutable(root, "checkpoint_parallel_dimensions");
  ReplaceIfPresent(dims, "tp_degree", Value::Int(plan.tp));
  ReplaceIfPresent(dims, "pp_degree", Value::Int(plan.pp));
  return root;
}

Value FreshRunModelStates(const Value& run) {
  const Value none = Value::None(), zero = Value::Int(0);
  Value root = Value::MakeDict({
      {Value::String("module"), none},
      {Value::String("buffer_names"), Value::MakeList({})},
      {Value::String("optimizer"), none},
      {Value::String("param_shapes"), Value::MakeList({})},
      {Value::String("frozen_param_shapes"), none},
      {Value::String("shared_params"), Value::MakeDict()},
      {Value::String("frozen_param_fragments"), none},
      {Value::String("lr_scheduler"), none},
      {Value::String("data_sampler"), none},
      {Value::String("random_ltd"), none},
      {Value::String("sparse_tensor_module_names"), Value::MakeSet({})},
      {Value::String("skipped_steps"), zero},
      {Value::String("global_steps"), zero},
      {Value::String("global_samples"), zero},
      {Value::String("dp_world_size"), Value::Int(1)},
      {Value::String("mp_world_size"), Value::Int(1)},
      {Value::String("args"), MakeNamespace({})},
      {Value::String("checkpoint_version"), Value::Float(3.0)},
      {Value::String("iteration"), zero},
      {Value::String("tokens"), zero},
  });
  if (const Items* items = DictItems(run)) {
    for (const auto& [key, value] : *items) Set(root, key.as_string(), value);
  }
  return root;
}

}  // namespace reshard
