#include "plan/plan.h"

#include <cstdio>

#include "plan/slicing.h"
#include "formats/deepspeed/stages.h"
#include "util/human.h"

namespace reshard {
namespace {

Status CheckOptions(const PlanOptions& o) {
  if (o.tp < 1) return Status::InvalidInput("target --tp must be at least 1");
  if (o.pp < 1) return Status::InvalidInput("target --pp must be at least 1");
  if (o.dp < 0) return Status::InvalidInput("target --dp must be at least 1");
  return Status::Ok();
}

// Rows of the target vocabulary tensors: the true vocabulary padded to a
// multiple of make_vocab_size_divisible_by x TP, as Megatron computes it.
Result<int64_t> TargetPaddedVocab(const LogicalCheckpoint& src, const PlanOptions& o) {
  const VocabInfo& vocab = src.vocab;
  if (vocab.padded_rows == 0 || o.tp == src.tp) return vocab.padded_rows;
  const std::optional<int64_t> true_size = o.vocab_size ? o.vocab_size : vocab.original_size;
  if (vocab.pad_to) {
    if (*vocab.pad_to % o.tp != 0) {
      return Status::InvalidInput("args.pad_vocab_size_to = " + std::to_string(*vocab.pad_to) +
                                  " does not divide by the target TP " + std::to_string(o.tp));
    }
    return *vocab.pad_to;
  }
  if (!true_size) {
    return Status::InvalidInput(
        "the checkpoint does not record its true vocabulary size (no checkpoint_info or "
        "universal_checkpoint_info), so the padding for TP " + std::to_string(o.tp) +
        " is unknown; pass --vocab-size N (the tokenizer's size)");
  }
  if (!vocab.divisible_by || *vocab.divisible_by < 1) {
    return Status::InvalidInput("args.make_vocab_size_divisible_by is not recorded; it is needed "
                                "to pad the vocabulary for the target TP");
  }
  const int64_t multiple = *vocab.divisible_by * o.tp;
  return (*true_size + multiple - 1) / multiple * multiple;
}

// Refuses a target TP the tensor's structure cannot take.
Status CheckSplittable(const LogicalLayer& layer, const LogicalTensor& t, int tp) {
  if (t.rule->policy != ParamRule::Policy::kSplit) return Status::Ok();
  const int64_t full = t.full_shape[t.rule->dim];
  const bool even = full % (static_cast<int64_t>(t.rule->parts) * tp) == 0;
  const bool whole_blocks = t.rule->blocks.empty() || t.blocks % tp == 0;
  if (even && whole_blocks) return Status::Ok();
  std::string why = !even ? "its " + std::to_string(full / t.rule->parts) + " rows per part"
                        : "its " + std::to_string(t.blocks) + " blocks (" +
                              t.rule->blocks.ToString() + ")";
  return Status::InvalidInput("cannot split " + TensorLabel(layer.id, t.key) + " over " +
                              std::to_string(tp) + " TP ranks: " + why + " do not divide by " +
                              std::to_string(tp));
}

TensorPlan PlanTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index, int rank,
                      const PlanOptions& o, int64_t padded_vocab) {
  const LogicalTensor& t = src.layers[layer_index].tensors[tensor_index];
  TensorPlan plan;
  plan.layer_index = layer_index;
  plan.tensor_index = tensor_index;
  plan.shape = TargetShardShape(t, o.tp, padded_vocab);
  const ParamRule& rule = *t.rule;
  if (rule.policy == ParamRule::Policy::kReplicated) {
    if (PolicyFor(rule, o.replicated) == ReplicatedPolicy::kAverage && src.tp > 1 &&
        IsFloatingPoint(t.dtype)) {
      plan.average = true;
    } else {
      plan.copies.push_back({0, 0, 0, 0, plan.shape.empty() ? 1 : plan.shape[0]});
    }
    return plan;
  }
  const bool vocab = rule.policy == ParamRule::Policy::kVocab;
  const int dim = vocab ? 0 : rule.dim;
  const int parts = vocab ? 1 : rule.parts;
  const int64_t src_full = t.full_shape[dim];
  const int64_t dst_full = vocab ? padded_vocab : src_full;
  std::vector<std::vector<Piece>> sources;
  for (int s = 0; s < src.tp; ++s) sources.push_back(RankPieces(src_full, parts, src.tp, s));
  const std::vector<Piece> target = RankPieces(dst_full, parts, o.tp, rank);
  plan.copies = IntersectPieces(target, sources, dim, std::min(src_full, dst_full));
  if (vocab) plan.fills = FillsBeyond(target, dim, src_full, o.vocab_pad_value);
  return plan;
}

Status PlanLayerFiles(const LogicalCheckpoint& src, const PlanOptions& o, Plan* plan) {
  for (size_t li = 0; li < src.layers.size(); ++li) {
    const LogicalLayer& layer = src.layers[li];
    for (const LogicalTensor& t : layer.tensors) {
      RESHARD_RETURN_IF_ERROR(CheckSplittable(layer, t, o.tp));
    }
    for (int rank = 0; rank < o.tp; ++rank) {
      LayerFilePlan file;
      file.name = LayerFileName(layer.id, rank);
      file.layer_index = static_cast<int>(li);
      file.tp_rank = rank;
      for (size_t ti = 0; ti < layer.tensors.size(); ++ti) {
        file.tensors.push_back(PlanTensor(src, static_cast<int>(li), static_cast<int>(ti), rank, o,
                                          plan->padded_vocab));
        file.bytes += file.tensors.back().numel() * ElementSize(layer.tensors[ti].dtype);
      }
      plan->layer_files.push_back(std::move(file));
    }
  }
  return Status::Ok();
}

void PlanModelStates(const LogicalCheckpoint& src, Plan* plan) {
  int without_source = 0;
  for (int p = 0; p < plan->pp; ++p) {
    const StageParameters stage = StageParams(src, plan->stage_bounds[p],
                                              plan->stage_bounds[p + 1], plan->tp,
                                              plan->padded_vocab);
    for (int t = 0; t < plan->tp; ++t) {
      ModelStatesPlan ms;
      ms.name = ModelStatesFileName(p * plan->tp + t);
      ms.pp_rank = p;
      ms.tp_rank = t;
      const bool has_source = p < src.pp && t < src.tp;
      ms.source_mp = has_source ? p * src.tp + t : 0;
      without_source += has_source ? 0 : 1;
      ms.param_shapes = stage.groups;
      ms.buffer_names = stage.buffers;
      plan->model_states.push_back(std::move(ms));
    }
  }
  if (without_source > 0) {
    plan->notes.push_back(
        "RNG: " + std::to_string(without_source) +
        " target rank(s) have no source rank at the same (pipeline, tensor) position and got the "
        "RNG state of mp_rank_00; resume with --no-load-rng for independent per-rank streams");
  }
}

void AddVocabNote(const LogicalCheckpoint& src, const PlanOptions& o, Plan* plan) {
  const int64_t from = src.vocab.padded_rows, to = plan->padded_vocab;
  if (from == to) return;
  std::string note = "vocabulary: " + std::to_string(from) + " padded rows -> " +
                     std::to_string(to) + " for TP " + std::to_string(o.tp);
  if (to > from) {
    char value[32];
    std::snprintf(value, sizeof(value), "%g", o.vocab_pad_value);
    note += "; new padding rows " + std::to_string(from) + "-" + std::to_string(to - 1) +
            " filled with " + value;
  } else {
    note += "; padding rows " + std::to_string(to) + "-" + std::to_string(from - 1) + " dropped";
  }
  plan->notes.push_back(note);
}

std::string DescribeSources(const TensorPlan& t) {
  if (t.average) return "mean of all TP replicas";
  std::string s;
  for (const SliceCopy& c : t.copies) {
    s += (s.empty() ? "" : ", ") + std::string("[") + std::to_string(c.dst_start) + "," +
         std::to_string(c.dst_start + c.length) + ") <- tp" + std::to_string(c.src_rank) + "[" +
         std::to_string(c.src_start) + "," + std::to_string(c.src_start + c.length) + ")";
  }
  for (const SliceFill& f : t.fills) {
    s += ", [" + std::to_string(f.dst_start) + "," + std::to_string(f.dst_start + f.length) +
         ") = " + std::to_string(f.value);
  }
  return s;
}

}  // namespace

int64_t TensorPlan::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Plan::TensorBytes() const {
  int64_t total = 0;
  for (const LayerFilePlan& f : layer_files) total += f.bytes;
  return total;
}

ReplicatedPolicy PolicyFor(const ParamRule& rule, ReplicatedPolicy command_line) {
  return rule.drift ? *rule.drift : command_line;
}

TensorPlan PlanFullTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index,
                          ReplicatedPolicy replicated) {
  PlanOptions whole;
  whole.tp = 1;
  whole.replicated = replicated;
  return PlanTensor(src, layer_index, tensor_index, 0, whole, src.vocab.padded_rows);
}

// A non-pipeline checkpoint keeps its TP layout and its one stage; the
// mp_rank files and optimizer shards are rewritten for the new DP size.
Result<Plan> MakeDataParallelPlan(const LogicalCheckpoint& src, const PlanOptions& options) {
  if (options.tp != src.tp || options.pp != 1 || !options.layers_per_stage.empty()) {
    return Status::InvalidInput(
        "a non-pipeline checkpoint (the whole model in mp_rank files) keeps its tensor-parallel "
        "layout; pass --tp " + std::to_string(src.tp) + " --pp 1 and choose the new --dp");
  }
  Plan plan;
  plan.tp = src.tp;
  plan.pp = 1;
  plan.dp = options.dp > 0 ? options.dp : src.dp;
  plan.optimizer = options.optimizer;
  plan.stage_bounds = {0, 0};
  for (int t = 0; t < src.tp; ++t) {
    ModelStatesPlan ms;
    ms.name = ModelStatesFileName(t);
    ms.tp_rank = t;
    ms.source_mp = t;
    ReadParamShapes(src.metadata[t], &ms.param_shapes);
    if (const Value* buffers = Find(src.metadata[t], "buffer_names");
        buffers != nullptr && buffers->is(Value::Kind::kList)) {
      for (const Value& b : buffers->as_list().items) {
        if (b.is(Value::Kind::kString)) ms.buffer_names.push_back(b.as_string());
      }
    }
    plan.model_states.push_back(std::move(ms));
  }
  return plan;
}

Result<Plan> MakePlan(const LogicalCheckpoint& src, const PlanOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckOptions(options));
  if (!src.pipeline) return MakeDataParallelPlan(src, options);
  Plan plan;
  plan.tp = options.tp;
  plan.pp = options.pp;
  plan.dp = options.dp > 0 ? options.dp : src.dp;
  plan.optimizer = options.optimizer;
  RESHARD_ASSIGN_OR_RETURN(plan.padded_vocab, TargetPaddedVocab(src, options));
  RESHARD_ASSIGN_OR_RETURN(plan.stage_bounds,
                           TargetStageBounds(src, options.pp, options.tp, plan.padded_vocab,
                                             options.layers_per_stage));
  RESHARD_RETURN_IF_ERROR(PlanLayerFiles(src, options, &plan));
  PlanModelStates(src, &plan);
  AddVocabNote(src, options, &plan);
  return plan;
}

std::string Plan::ToString(const LogicalCheckpoint& src, bool detail) const {
  std::string out = "target: TP " + std::to_string(tp) + ", PP " + std::to_string(pp) + ", DP " +
                    std::to_string(dp) + "; stage bounds (spec ids)";
  for (int b : stage_bounds) out += " " + std::to_string(b);
  if (padded_vocab > 0) out += "; padded vocabulary " + std::to_string(padded_vocab);
  out += "\n";
  for (const LayerFilePlan& f : layer_files) {
    const LogicalLayer& layer = src.layers[f.layer_index];
    out += "  " + f.name + "  " + layer.role + ", " + std::to_string(f.tensors.size()) +
           " tensors, " + HumanBytes(f.bytes) + "\n";
    if (!detail) continue;
    for (const TensorPlan& t : f.tensors) {
      const LogicalTensor& lt = layer.tensors[t.tensor_index];
      out += "    " + lt.key + " " + DTypeName(lt.dtype) + ShapeString(t.shape) + " (" +
             lt.rule->Describe() + "): " + DescribeSources(t) + "\n";
    }
  }
  for (const ModelStatesPlan& m : model_states) {
    size_t params = 0;
    for (const auto& g : m.param_shapes) params += g.size();
    const int first = stage_bounds[m.pp_rank], last = stage_bounds[m.pp_rank + 1] - 1;
    const std::string specs = last >= first ? "specs " + std::to_string(first) + "-" + std::to_string(last)
                                            : std::string("the whole model");
    out += "  " + m.name + "  stage " + std::to_string(m.pp_rank) + " (" + specs + "), " +
           std::to_string(params) +
           " parameters in " + std::to_string(m.param_shapes.size()) +
           " groups, metadata from " + ModelStatesName(m.source_mp) + "\n";
  }
  const size_t optimizer_files = optimizer ? model_states.size() * dp : 0;
  if (optimizer) {
    out += "  " + std::to_string(optimizer_files) + " optimizer shards: DP " + std::to_string(dp) +
           " for each of the " + std::to_string(model_states.size()) + " (pipeline, tensor) ranks\n";
  }
  out += "total: " + std::to_string(layer_files.size() + model_states.size() + optimizer_files) +
         " files, " + HumanBytes(TensorBytes()) + " of weights\n";
  return out;
}

}  // namespace reshard
