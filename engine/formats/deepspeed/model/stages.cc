#include "formats/deepspeed/model/stages.h"

#include <map>

#include "formats/deepspeed/model/stage_partition.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {

std::string PartitionMethod(const LogicalCheckpoint& src) {
  const Value* v = src.rules->partition_method_arg().Lookup(src.inputs());
  return v != nullptr && v->is(Value::Kind::kString) ? v->as_string()
                                                      : src.rules->partition_method_default();
}

namespace {

const LogicalLayer* LayerById(const LogicalCheckpoint& src, int id) {
  for (const LogicalLayer& layer : src.layers) {
    if (layer.id == id) return &layer;
  }
  return nullptr;
}

// The file-owning spec the tied head shares its module with (the embedding):
// the first one whose class is the tied head's. -1 for untied models.
int TiedLayerId(const LogicalCheckpoint& src) {
  if (src.rules->tied_module().empty()) return -1;
  std::string tied_class;
  for (const SpecEntry& s : src.specs) {
    if (s.role == "tied_head") tied_class = s.class_name;
  }
  if (tied_class.empty()) return -1;
  for (size_t i = 0; i < src.specs.size(); ++i) {
    if (src.specs[i].OwnsFile() && src.specs[i].class_name == tied_class) return static_cast<int>(i);
  }
  return -1;
}

// Trainable parameter count of each spec, as DeepSpeed's `parameters` method
// sees it: it builds each spec on one rank, so a MoE layer counts the E/EP
// experts of an EP rank (the layer here holds all E).
std::vector<SpecWeight> SpecWeights(const LogicalCheckpoint& src, int tp, int64_t padded_vocab, int ep) {
  const int tied_id = TiedLayerId(src);
  std::vector<SpecWeight> weights;
  for (size_t i = 0; i < src.specs.size(); ++i) {
    SpecWeight w{src.specs[i].class_name, 0};
    const bool tied_head = src.specs[i].role == "tied_head";
    const LogicalLayer* layer = LayerById(src, tied_head ? tied_id : static_cast<int>(i));
    int64_t experts = 0;  // every expert's parameters
    if (layer != nullptr) {
      for (const LogicalTensor& t : layer->tensors) {
        if (t.rule->buffer || (tied_head && !t.rule->tied)) continue;
        (t.rule->expert > 0 ? experts : w.num_params) += ShapeNumel(TargetShardShape(t, tp, padded_vocab));
      }
    }
    w.num_params += experts / ep;
    weights.push_back(w);
  }
  return weights;
}

std::vector<int> BoundsFromBlockCounts(const LogicalCheckpoint& src,
                                       const std::vector<int>& per_stage) {
  std::vector<int> block_ids;
  for (size_t i = 0; i < src.specs.size(); ++i) {
    if (src.specs[i].role == "block") block_ids.push_back(static_cast<int>(i));
  }
  std::vector<int> bounds{0};
  int seen = 0;
  for (size_t p = 0; p + 1 < per_stage.size(); ++p) {
    seen += per_stage[p];
    bounds.push_back(block_ids[seen]);
  }
  bounds.push_back(static_cast<int>(src.specs.size()));
  return bounds;
}

Status CheckLayersPerStage(const std::vector<int>& per_stage, int pp, int blocks) {
  if (static_cast<int>(per_stage.size()) != pp) {
    return Status::InvalidInput("--layers-per-stage lists " + std::to_string(per_stage.size()) +
                                " stages but the target PP is " + std::to_string(pp));
  }
  int sum = 0;
  for (int n : per_stage) {
    if (n < 1) return Status::InvalidInput("--layers-per-stage: every stage needs at least one block");
    sum += n;
  }
  if (sum != blocks) {
    return Status::InvalidInput("--layers-per-stage sums to " + std::to_string(sum) +
                                " but the model has " + Count(blocks, "block"));
  }
  return Status::Ok();
}

void AddParams(const LogicalLayer& layer, const std::string& prefix, bool tied_head_only, int tp,
               int64_t padded_vocab, std::vector<ParamShape>* params,
               std::vector<std::string>* buffers) {
  for (const LogicalTensor& t : layer.tensors) {
    if (tied_head_only && !t.rule->tied) continue;
    if (t.rule->buffer) {
      buffers->push_back(prefix + t.key);
    } else {
      params->push_back({prefix + t.key, TargetShardShape(t, tp, padded_vocab)});
    }
  }
}


}  // namespace

Result<std::vector<int>> TargetStageBounds(const LogicalCheckpoint& src, int pp, int tp,
                                           int64_t padded_vocab,
                                           const std::vector<int>& layers_per_stage, int ep) {
  int blocks = 0;
  for (const SpecEntry& s : src.specs) blocks += s.role == "block" ? 1 : 0;
  if (pp > blocks) {
    return Status::InvalidInput("target PP " + std::to_string(pp) + " exceeds the " +
                                Count(blocks, "transformer block") + "; every stage needs at least one");
  }
  if (!layers_per_stage.empty()) {
    RESHARD_RETURN_IF_ERROR(CheckLayersPerStage(layers_per_stage, pp, blocks));
    return BoundsFromBlockCounts(src, layers_per_stage);
  }
  const std::string method = PartitionMethod(src);
  RESHARD_ASSIGN_OR_RETURN(std::vector<int> bounds,
                           PartitionStages(method, SpecWeights(src, tp, padded_vocab, ep), pp));
  for (int p = 0; p < pp; ++p) {
    bool has_block = false;
    for (int i = bounds[p]; i < bounds[p + 1]; ++i) has_block |= src.specs[i].role == "block";
    if (!has_block) {
      return Status::InvalidInput("DeepSpeed's partition method '" + method + "' leaves stage " +
                                  std::to_string(p) + " of " + std::to_string(pp) +
                                  " without a transformer block; choose the split with "
                                  "--layers-per-stage");
    }
  }
  return bounds;
}

std::string ParamName(const LogicalCheckpoint& src, int layer_index, int tensor_index) {
  const LogicalLayer& layer = src.layers[layer_index];
  const std::string& key = layer.tensors[tensor_index].key;
  if (layer.id == TiedLayerId(src)) return "tied_modules." + src.rules->tied_module() + "." + key;
  return std::to_string(layer.id) + "." + key;
}

bool ReadParamShapes(const Value& metadata, std::vector<std::vector<ParamShape>>* out) {
  const Value* shapes = Find(metadata, "param_shapes");
  if (shapes == nullptr || !shapes->is(Value::Kind::kList)) return false;
  for (const Value& group : shapes->as_list().items) {
    const Items* items = DictItems(group);
    if (items == nullptr) return false;
    std::vector<ParamShape> g;
    int64_t total = 0;  // bounded, as flat group layouts add and pad these counts
    for (const auto& [k, v] : *items) {
      std::vector<int64_t> dims;
      if (!k.is(Value::Kind::kString) || !ReadIntSequence(v, &dims)) return false;
      const int64_t n = CheckedShapeNumel(dims);
      if (n < 0 || n > kMaxElements - total) return false;
      total += n;
      g.emplace_back(k.as_string(), dims);
    }
    out->push_back(std::move(g));
  }
  return true;
}

bool ResolveParamName(const LogicalCheckpoint& src, const std::string& name, int* layer_index,
                      int* tensor_index) {
  const std::string tied_prefix = "tied_modules." + src.rules->tied_module() + ".";
  int id = -1;
  std::string key;
  if (!src.rules->tied_module().empty() && name.rfind(tied_prefix, 0) == 0) {
    id = TiedLayerId(src);
    key = name.substr(tied_prefix.size());
  } else {
    const size_t dot = name.find('.');
    if (dot == std::string::npos || dot == 0) return false;
    for (size_t i = 0; i < dot; ++i) {
      if (name[i] < '0' || name[i] > '9') return false;
    }
    id = std::stoi(name.substr(0, dot));
    key = name.substr(dot + 1);
  }
  for (size_t li = 0; li < src.layers.size(); ++li) {
    if (src.layers[li].id != id) continue;
    for (size_t ti = 0; ti < src.layers[li].tensors.size(); ++ti) {
      if (src.layers[li].tensors[ti].key != key) continue;
      *layer_index = static_cast<int>(li);
      *tensor_index = static_cast<int>(ti);
      return true;
    }
  }
  return false;
}

StageParameters StageParams(const LogicalCheckpoint& src, int begin, int end, int tp,
                            int64_t padded_vocab) {
  const int tied_id = TiedLayerId(src);
  bool has_tied_layer = false, has_tied_head = false;
  for (int i = begin; i < end; ++i) {
    has_tied_layer |= i == tied_id;
    has_tied_head |= src.specs[i].role == "tied_head";
  }
  std::vector<ParamShape> params;
  StageParameters out;
  // DeepSpeed registers tied modules before the stage's layers.
  if (tied_id >= 0 && (has_tied_layer || has_tied_head)) {
    AddParams(*LayerById(src, tied_id), "tied_modules." + src.rules->tied_module() + ".",
              !has_tied_layer, tp, padded_vocab, &params, &out.buffers);
  }
  for (int i = begin; i < end; ++i) {
    const LogicalLayer* layer = LayerById(src, i);
    if (layer == nullptr || i == tied_id) continue;
    AddParams(*layer, std::to_string(i) + ".", false, tp, padded_vocab, &params, &out.buffers);
  }
  out.groups = GroupParams(params, src.rules->optimizer_groups());
  return out;
}

}  // namespace reshard
