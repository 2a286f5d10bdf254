#include "formats/deepspeed/pipeline/pipeline_plan.h"

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/model/stages.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

Status CheckOptions(const PlanOptions& o) {
  if (o.tp < 1) return Status::InvalidInput("target --tp must be at least 1");
  if (o.pp < 1) return Status::InvalidInput("target --pp must be at least 1");
  if (o.dp < 0) return Status::InvalidInput("target --dp must be at least 1");
  return Status::Ok();
}

TensorTarget TargetOf(const PlanOptions& o, int64_t padded_vocab) {
  return TensorTarget{o.tp, padded_vocab, o.replicated, o.vocab_pad_value};
}

Status PlanLayerFiles(const LogicalCheckpoint& src, const PlanOptions& o, DeepSpeedPlan* plan) {
  const TensorTarget target = TargetOf(o, plan->padded_vocab);
  for (size_t li = 0; li < src.layers.size(); ++li) {
    const LogicalLayer& layer = src.layers[li];
    for (const LogicalTensor& t : layer.tensors) RESHARD_RETURN_IF_ERROR(CheckSplittable(t, o.tp));
    for (int rank = 0; rank < o.tp; ++rank) {
      LayerFilePlan file;
      file.name = LayerFileName(layer.id, rank);
      file.layer_index = static_cast<int>(li);
      file.tp_rank = rank;
      for (size_t ti = 0; ti < layer.tensors.size(); ++ti) {
        file.tensors.push_back(
            PlanTensor(src, static_cast<int>(li), static_cast<int>(ti), rank, target));
      }
      plan->layer_files.push_back(std::move(file));
    }
  }
  return Status::Ok();
}

// Megatron's RNG keys: MS's rng_state list, BS's flat random_rng_state, ...
bool HasRngState(const Value& metadata) {
  return Find(metadata, "rng_state") != nullptr || Find(metadata, "random_rng_state") != nullptr;
}

void PlanModelStates(const LogicalCheckpoint& src, DeepSpeedPlan* plan) {
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
  if (!HasRngState(src.metadata[0])) {
    plan->notes.push_back("RNG: the source records no RNG state, so the target has none; resume with "
                          "--no-load-rng (or --finetune)");
  } else if (without_source > 0) {
    plan->notes.push_back(
        "RNG: " + std::to_string(without_source) +
        " target rank(s) have no source rank at the same (pipeline, tensor) position and got the "
        "RNG state of mp_rank_00; resume with --no-load-rng for independent per-rank streams");
  }
}

void AddVocabNote(const LogicalCheckpoint& src, const PlanOptions& o, DeepSpeedPlan* plan) {
  std::string note = VocabPaddingNote(src.vocab.padded_rows, plan->padded_vocab, o.tp, o.vocab_pad_value);
  if (!note.empty()) plan->notes.push_back(std::move(note));
}

// A pipeline slot's optimizer state follows its weight's plan for this TP rank.
Status PlanPipelineSlot(const LogicalCheckpoint& src, const DeepSpeedPlan& plan, int tp_rank,
                        const FlatSlot& flat, OptimizerSlotPlan* slot) {
  int li = 0, ti = 0;
  if (!ResolveParamName(src, flat.name, &li, &ti)) {
    return Status::InvalidInput("the optimizer shards hold " + flat.name +
                                ", which is not a tensor of the layer files");
  }
  // Layer files are planned layer by layer, TP rank by TP rank.
  slot->master = plan.layer_files[li * plan.tp + tp_rank].tensors[ti];
  return Status::Ok();
}

// Without pipelining the TP layout is unchanged: TP rank t's state is the
// source rank's own.
void PlanLocalSlot(int tp_rank, const FlatSlot& flat, OptimizerSlotPlan* slot) {
  slot->master = WholeShardPlan(tp_rank, flat.numel);
}

Status PlanOptimizer(const LogicalCheckpoint& src, const SourceOptimizer& opt, DeepSpeedPlan* plan) {
  plan->optimizer_format = opt.format();
  const int dp = opt.format().embedded ? 1 : plan->dp;  // without ZeRO nothing is partitioned
  for (const ModelStatesPlan& ms : plan->model_states) {
    OptimizerStagePlan stage;
    stage.pp_rank = ms.pp_rank;
    stage.tp_rank = ms.tp_rank;
    for (const auto& params : ms.param_shapes) {
      stage.groups.emplace_back(params, dp, opt.format().Alignment(dp));
    }
    if (static_cast<int>(stage.groups.size()) != opt.num_groups()) {
      return Status::Unsupported("target stage " + std::to_string(ms.pp_rank) + " has " +
                                 std::to_string(stage.groups.size()) +
                                 " optimizer groups but the source has " +
                                 std::to_string(opt.num_groups()));
    }
    for (const FlatGroup& group : stage.groups) {
      stage.slots.emplace_back();
      for (const FlatSlot& flat : group.slots()) {
        OptimizerSlotPlan slot;
        slot.source_param = flat.name;
        if (plan->pipeline) {
          RESHARD_RETURN_IF_ERROR(PlanPipelineSlot(src, *plan, ms.tp_rank, flat, &slot));
        } else {
          PlanLocalSlot(ms.tp_rank, flat, &slot);
        }
        slot.moment = slot.master;
        for (BoxFill& f : slot.moment.fills) f.value = 0;
        stage.slots.back().push_back(std::move(slot));
      }
    }
    plan->optimizer.push_back(std::move(stage));
  }
  return Status::Ok();
}

Status PlanOptimizerIfAny(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                          const PlanOptions& o, DeepSpeedPlan* plan) {
  plan->drop_embedded_optimizer = o.weights_only;
  if (opt == nullptr || o.weights_only) return Status::Ok();
  return PlanOptimizer(src, *opt, plan);
}

std::string DescribePartition(const FlatGroup& group, const std::vector<OptimizerSlotPlan>& slots,
                              int d) {
  std::string s;
  for (const Fragment& f : group.Fragments(d)) {
    s += (s.empty() ? "" : ", ") + std::string("[") + std::to_string(f.partition_start) + "," +
         std::to_string(f.partition_start + f.numel) + ") <- " + slots[f.slot].source_param + "[" +
         std::to_string(f.param_offset) + "," + std::to_string(f.param_offset + f.numel) + ")";
  }
  const int64_t padding = group.PaddingIn(d);
  if (padding > 0) s += (s.empty() ? "" : ", ") + std::to_string(padding) + " padding";
  return s;
}

}  // namespace

PlanOptions PlanOptionsFrom(const DeepSpeedPlanOptions& o) {
  PlanOptions p;
  p.tp = o.target_tp;
  p.pp = o.target_pp;
  p.dp = o.target_dp;
  p.layers_per_stage = o.layers_per_stage;
  p.replicated = o.replicated;
  p.vocab_size = o.vocab_size;
  p.vocab_pad_value = o.vocab_pad_value;
  p.weights_only = o.weights_only;
  return p;
}

Result<DeepSpeedPlan> MakeDataParallelPlan(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                           const PlanOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckOptions(options));
  if (options.tp != src.tp || options.pp != 1 || !options.layers_per_stage.empty()) {
    return Status::InvalidInput(
        "a non-pipeline checkpoint (the whole model in mp_rank files) keeps its tensor-parallel "
        "layout; pass --tp " + std::to_string(src.tp) + " --pp 1 and choose the new --dp");
  }
  DeepSpeedPlan plan;
  plan.pipeline = false;
  plan.tp = src.tp;
  plan.pp = 1;
  plan.dp = options.dp > 0 ? options.dp : src.dp;
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
  RESHARD_RETURN_IF_ERROR(PlanOptimizerIfAny(src, opt, options, &plan));
  return plan;
}

Result<DeepSpeedPlan> MakePipelinePlan(const LogicalCheckpoint& src, const SourceOptimizer* opt,
                                       const PlanOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckOptions(options));
  DeepSpeedPlan plan;
  plan.tp = options.tp;
  plan.pp = options.pp;
  plan.dp = options.dp > 0 ? options.dp : src.dp;
  RESHARD_ASSIGN_OR_RETURN(plan.padded_vocab, TargetPaddedVocab(src, options.tp, options.vocab_size));
  RESHARD_ASSIGN_OR_RETURN(plan.stage_bounds,
                           TargetStageBounds(src, options.pp, options.tp, plan.padded_vocab,
                                             options.layers_per_stage));
  RESHARD_RETURN_IF_ERROR(PlanLayerFiles(src, options, &plan));
  PlanModelStates(src, &plan);
  AddVocabNote(src, options, &plan);
  RESHARD_RETURN_IF_ERROR(PlanOptimizerIfAny(src, opt, options, &plan));
  return plan;
}

std::string DeepSpeedPlan::Summary() const {
  std::string out = "target: TP " + std::to_string(tp) + ", PP " + std::to_string(pp) + ", DP " +
                    std::to_string(dp) + "; stage bounds (spec ids)";
  for (int b : stage_bounds) out += " " + std::to_string(b);
  if (padded_vocab > 0) out += "; padded vocabulary " + std::to_string(padded_vocab);
  return out + "\n";
}

std::string DeepSpeedPlan::ModelStatesWhat(const ModelStatesPlan& m) const {
  size_t params = 0;
  for (const auto& g : m.param_shapes) params += g.size();
  const int first = stage_bounds[m.pp_rank], last = stage_bounds[m.pp_rank + 1] - 1;
  const std::string specs = last >= first ? "specs " + std::to_string(first) + "-" + std::to_string(last)
                                          : std::string("the whole model");
  return "stage " + std::to_string(m.pp_rank) + " (" + specs + "), " + Count(static_cast<int64_t>(params), "parameter") +
         " in " + Count(static_cast<int64_t>(m.param_shapes.size()), "group") + ", metadata from " +
         ModelStatesName(m.source_mp);
}

std::vector<std::string> DeepSpeedPlan::OptimizerDetail(const OptimizerStagePlan& stage, int d) const {
  std::vector<std::string> out;
  int64_t index = 0;
  for (size_t g = 0; g < stage.groups.size(); ++g) {
    const FlatGroup& group = stage.groups[g];
    if (optimizer_format.per_parameter) {
      out.push_back("group " + std::to_string(g) + ": torch state of " + Count(static_cast<int64_t>(group.slots().size()), "parameter") +
                    ", " + std::to_string(group.numel()) + " elements per state, each sliced like its weight");
      for (const FlatSlot& slot : group.slots()) {
        out.push_back("  " + std::to_string(index++) + ": " + slot.name + " " + ShapeString(slot.shape));
      }
      continue;
    }
    out.push_back("group " + std::to_string(g) + ": " + Count(static_cast<int64_t>(group.slots().size()), "parameter") + ", " +
                  std::to_string(group.numel()) + " elements padded to " + std::to_string(group.padded()) + ", " +
                  Count(group.dp(), "partition") + " of " + std::to_string(group.partition()) + "; partition " +
                  std::to_string(stage.PartitionOf(static_cast<int>(g), d)) + ": " +
                  DescribePartition(group, stage.slots[g], stage.PartitionOf(static_cast<int>(g), d)));
  }
  return out;
}

}  // namespace reshard
