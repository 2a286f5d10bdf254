#include "formats/megatron_core/torch/megatron_export.h"

#include <algorithm>
#include <array>
#include <functional>
#include <optional>

#include "formats/megatron_core/common/megatron_args.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/megatron_param_groups.h"
#include "formats/megatron_core/common/adam_states.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "formats/megatron_core/torch/distrib_optim.h"
#include "formats/state_dict.h"
#include "logical/logical_checkpoint.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kLayerSpec[] = "layer-spec";  // the option choosing the keys

// One tensor of a file: a rank tensor at its place in `model`.
struct FileTensor {
  int chunk = 0;  // the model chunk holding it
  std::vector<std::string> path;
  size_t source = 0;   // index into TpWeights::ranks[tp_rank]
  std::string detail;  // for --dry-run: where the elements come from
};

// Megatron-Core's modules' `_extra_state` entries of a model chunk: key -> value.
using ExtraStates = std::vector<std::pair<std::string, Value>>;

struct MegatronFile {
  std::string name;
  int tp_rank = 0, pp_rank = 0;
  std::vector<FileTensor> tensors;
  std::vector<ExtraStates> extra_states;  // each model chunk's
};

// Whose model's keys the files hold.
enum class Keys { kLegacy, kLocal, kTransformerEngine };

// Everything the export writes, as plain data.
struct MegatronExportPlan {
  Keys keys = Keys::kLocal;
  const RuleSet* rules = nullptr;
  const TorchDistLayout* layout = nullptr;  // the rule set's names of the keys (not for kLegacy)
  TpCut cut;
  int pp = 1;
  TargetPipeline pipeline;  // the layers of each stage
  int64_t iteration = 0;
  int64_t padded_vocab = 0;
  std::optional<DType> dtype;  // floating tensors cast to it; unset = as the source gives them
  std::optional<Value> args;   // absent when the source records none
  std::vector<MegatronFile> files;  // stage by stage, TP rank by TP rank
  // model_optim_rng.pt's `optimizer` entry, when the distributed optimizer's
  // state is written (distrib_optim.pt beside each file).
  std::optional<Value> optimizer;
  std::optional<Value> lr_scheduler;  // the source's, carried under Megatron-LM's legacy key
};

Status CheckSource(const SourceCheckpoint& src) {
  if (src.info().has_experts) {
    return Status::Unsupported("export --to megatron: this checkpoint has DeepSpeed MoE experts, which Megatron-LM's "
                               "legacy GPT model does not lay out; export --to consolidated writes its tensors");
  }
  if (src.info().rules == nullptr) {
    return Status::Unsupported("export --to megatron cuts tensors by the rule set that describes a pipeline "
                               "checkpoint, and this " + src.info().kind + " checkpoint is read without one" +
                               src.info().NoRulesWhy() + "; export --to consolidated writes its tensors");
  }
  return Status::Ok();
}

// The keys `options` ask for, and the rule set's names of them. Without
// --layer-spec, a family whose rule set names no Megatron-Core keys (BLOOM,
// GLU: architectures Megatron-Core does not build) keeps the legacy ones.
Status ChooseKeys(const SourceCheckpoint& src, const ExportOptions& options, MegatronExportPlan* plan,
                  std::vector<std::string>* notes) {
  plan->rules = src.info().rules.get();
  plan->layout = plan->rules->section<TorchDistLayout>();
  const std::string layer_spec = FormatOption(options, kLayerSpec);
  if (layer_spec == "legacy") {
    plan->keys = Keys::kLegacy;
  } else if (plan->layout != nullptr) {
    plan->keys = layer_spec == "te" ? Keys::kTransformerEngine : Keys::kLocal;
  } else if (layer_spec.empty()) {
    plan->keys = Keys::kLegacy;
    notes->push_back("megatron: rule set " + plan->rules->name() + " names no Megatron-Core keys (it has no "
                     "torch_dist section), so the files hold the legacy GPTModel's");
  } else {
    return Status::Unsupported("--layer-spec " + layer_spec + " writes Megatron-Core's keys as the rule "
                               "set's torch_dist section names them, and rule set " + plan->rules->name() +
                               " has none; add one (docs/rules.md), or use --layer-spec legacy");
  }
  return Status::Ok();
}

Result<TpCut> CutOf(const ExportOptions& options) {
  if (options.tp < 1 || options.pp < 1) {
    return Status::InvalidInput("export --to megatron needs the target layout: --tp N and --pp N (both >= 1)");
  }
  const bool masters = FormatOption(options, "from") == "masters";
  if (masters && options.weights_only) {
    return Status::InvalidInput("--from masters and --weights-only contradict each other; keep one");
  }
  return TpCut{options.tp, options.replicated, options.vocab_size, masters ? kFp32Master : ""};
}

// The source's data-parallel size, which the export keeps; the world size is
// then TP x PP x DP of the target (Megatron-LM checks the batch sizes by it).
int SourceDp(const SourceCheckpoint& src) {
  const Value* args = Find(src.info().metadata, "args");
  const int64_t dp = MetadataInt(args != nullptr ? *args : Value(), "data_parallel_size",
                                 MetadataInt(src.info().metadata, "dp_world_size", 1));
  return dp >= 1 ? static_cast<int>(dp) : 1;
}

int CountBlocks(const std::vector<RankTensor>& tensors) {
  int blocks = 0;
  for (const RankTensor& t : tensors) blocks = std::max(blocks, t.block + 1);
  return blocks;
}

LayerSpec SpecOf(Keys keys) { return keys == Keys::kLocal ? LayerSpec::kLocal : LayerSpec::kTransformerEngine; }

// A rank tensor's place in Megatron-Core's GPTModel: one flat key, its
// layer index local to the stage.
Result<ModelPlace> McorePlaceOf(const MegatronExportPlan& plan, const RankTensor& r) {
  RESHARD_ASSIGN_OR_RETURN(const TorchDistTensor* entry, TorchDistEntryOf(*plan.rules, r, "megatron"));
  if (ExpertOf(r) >= 0) {
    return Status::Unsupported("export --to megatron: " + r.name + " is an expert's, and the torch format's "
                               "experts (local_experts.<i>) are not written yet; export --to torch_dist");
  }
  const std::string& key = TorchDistLayout::KeyOf(*entry, SpecOf(plan.keys));
  if (r.block < 0) {
    const PipelineStages::Where at = ChunkOfModule(key, plan.pipeline.stages);
    return ModelPlace{at.stage, at.chunk, {key}};
  }
  const PipelineStages::Where at = plan.pipeline.stages.Locate(r.block);
  RESHARD_ASSIGN_OR_RETURN(std::string layer_key, LayerKey(key, at.local));
  return ModelPlace{at.stage, at.chunk, {std::move(layer_key)}};
}

Result<ModelPlace> PlaceOfTensor(const MegatronExportPlan& plan, const RankTensor& r) {
  if (plan.keys == Keys::kLegacy) return PlaceOf(r.rule->role, r.key, r.block, plan.pipeline.stages);
  return McorePlaceOf(plan, r);
}

// The last stage's copy of a tied embedding: the legacy model's
// word_embeddings_for_head, Megatron-Core's output layer (the rule set's
// tied_head).
Result<ModelPlace> TiedHeadPlace(const MegatronExportPlan& plan) {
  if (plan.keys == Keys::kLegacy) return HeadEmbeddingPlace(plan.pipeline.stages);
  if (plan.layout->tied_head.empty()) {
    return Status::Unsupported("export --to megatron: rule set " + plan.rules->name() + " ties the embedding, and its "
                               "torch_dist section names no tied_head key for the last stage's copy; add one "
                               "(docs/rules.md)");
  }
  return ModelPlace{plan.pp - 1, plan.pipeline.vpp() - 1, {plan.layout->tied_head}};
}

// Places every rank tensor in its stage's file; the last stage's copy of a
// tied embedding (PP > 1) comes after the language model, as Megatron-LM
// writes it.
Status PlaceTensors(const TpWeights& weights, MegatronExportPlan* plan) {
  const int tp = plan->cut.tp, pp = plan->pp;
  for (int p = 0; p < pp; ++p) {
    for (int t = 0; t < tp; ++t) {
      plan->files.push_back(
          {MegatronFileName(plan->iteration, t, p, pp), t, p, {}, std::vector<ExtraStates>(plan->pipeline.vpp())});
    }
  }
  for (int t = 0; t < tp; ++t) {
    const std::vector<RankTensor>& tensors = weights.ranks[t];
    std::vector<std::pair<ModelPlace, size_t>> places;
    for (size_t i = 0; i < tensors.size(); ++i) {
      RESHARD_ASSIGN_OR_RETURN(ModelPlace place, PlaceOfTensor(*plan, tensors[i]));
      places.emplace_back(std::move(place), i);
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (pp == 1 || !IsTiedVocab(tensors[i])) continue;
      RESHARD_ASSIGN_OR_RETURN(ModelPlace place, TiedHeadPlace(*plan));
      places.emplace_back(std::move(place), i);
    }
    for (const auto& [at, i] : places) {
      const RankTensor& r = tensors[i];
      plan->files[at.stage * tp + t].tensors.push_back({at.chunk, at.path, i, r.Label()});
    }
  }
  return Status::Ok();
}

// What a module's state_dict() holds as `_extra_state` without FP8 state:
// Megatron-Core's own modules None, Transformer Engine's an empty uint8
// tensor.
Value ExtraState(bool transformer_engine) {
  if (!transformer_engine) return Value::None();
  return MakeProducedTensor(DType::kUInt8, {0}, [](int64_t, int64_t, uint8_t*) { return Status::Ok(); });
}

// Adds `module`'s `_extra_state` to the model chunks holding it: every
// layer of every chunk for a layer module, else its one chunk.
Status AddExtraState(const std::string& module, bool transformer_engine, MegatronExportPlan* plan) {
  const int tp = plan->cut.tp;
  const PipelineStages& stages = plan->pipeline.stages;
  for (int p = 0; p < plan->pp; ++p) {
    for (int c = 0; c < stages.vpp(); ++c) {
      std::vector<std::string> keys;
      if (IsLayerKey(module)) {
        for (int l = 0; l < stages.ChunkLayers(p, c); ++l) {
          RESHARD_ASSIGN_OR_RETURN(std::string key, LayerKey(module, l));
          keys.push_back(std::move(key));
        }
      } else if (const PipelineStages::Where at = ChunkOfModule(module, stages); at.stage == p && at.chunk == c) {
        keys.push_back(module);
      }
      for (int t = 0; t < tp; ++t) {
        for (const std::string& key : keys) {
          plan->files[p * tp + t].extra_states[c].emplace_back(key + "._extra_state", ExtraState(transformer_engine));
        }
      }
    }
  }
  return Status::Ok();
}

// Every `_extra_state` the spec's modules hold (rules/rule_set.h,
// TorchDistLayout): the linear layers' (TE's in the TE spec), Megatron-Core's
// output layer's, and TE's other modules' in the TE spec.
Status AddExtraStates(MegatronExportPlan* plan) {
  if (plan->keys == Keys::kLegacy) return Status::Ok();
  const bool te = plan->keys == Keys::kTransformerEngine;
  for (const std::string& m : plan->layout->extra_state) RESHARD_RETURN_IF_ERROR(AddExtraState(m, te, plan));
  for (const std::string& m : plan->layout->torch_extra_state) RESHARD_RETURN_IF_ERROR(AddExtraState(m, false, plan));
  if (!te) return Status::Ok();
  for (const std::string& m : plan->layout->te_extra_state) RESHARD_RETURN_IF_ERROR(AddExtraState(m, true, plan));
  return Status::Ok();
}

// Sets `value` at `path` under `root`, making the dicts on the way: plain
// dicts for Megatron's nesting, an OrderedDict (a module's state_dict()) for
// the one holding the tensor.
void Insert(Value* root, const std::vector<std::string>& path, Value value) {
  Value* at = root;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    if (Find(*at, path[i]) == nullptr) {
      Set(*at, path[i], i + 2 == path.size() ? MakeOrderedDict({}) : Value::MakeDict());
    }
    at = FindMutable(*at, path[i]);
  }
  Set(*at, path.back(), std::move(value));
}

// What Megatron-LM's generate_state_dict holds for one rank, in its order:
// `model`, or a virtual pipeline's `model0`, `model1`, ...
Value FileTree(const MegatronExportPlan& plan, const MegatronFile& f, const std::vector<RankTensor>& tensors) {
  Value root = Value::MakeDict();
  if (plan.args) Set(root, "args", *plan.args);
  Set(root, "checkpoint_version", Value::Float(3.0));
  Set(root, "iteration", Value::Int(plan.iteration));
  const int vpp = plan.pipeline.vpp();
  for (int c = 0; c < vpp; ++c) {
    // Megatron-Core's model is one module's state_dict(), the legacy one's nests them.
    Value model = plan.keys == Keys::kLegacy ? Value::MakeDict() : MakeOrderedDict({});
    for (const FileTensor& t : f.tensors) {
      if (t.chunk != c) continue;
      const RankTensor& r = tensors[t.source];
      const DType dtype = WrittenDType(r, plan.dtype);
      ByteProducer bytes = dtype == r.dtype ? r.produce : CastBytes(r.produce, r.dtype, dtype);
      Insert(&model, t.path, MakeProducedTensor(dtype, r.shape, std::move(bytes)));
    }
    for (const auto& [key, state] : f.extra_states[c]) Set(model, key, state);
    Set(root, ModelChunkKey(c, vpp), std::move(model));
  }
  if (plan.optimizer) Set(root, "optimizer", *plan.optimizer);
  if (plan.lr_scheduler) Set(root, "lr_scheduler", *plan.lr_scheduler);
  return root;
}

Result<PlannedFile> PlanFile(const MegatronExportPlan& plan, const MegatronFile& f,
                             const std::vector<RankTensor>& tensors) {
  RESHARD_ASSIGN_OR_RETURN(PlannedFile file,
                           TorchFile(f.name, "stage " + std::to_string(f.pp_rank) + ", TP rank " +
                                                 std::to_string(f.tp_rank), FileTree(plan, f, tensors)));
  for (const FileTensor& t : f.tensors) {
    SetFrom(&file, ModelChunkKey(t.chunk, plan.pipeline.vpp()) + "/" + Join(t.path, "/"), t.detail);
  }
  return file;
}

// Whether the source's optimizer state is written: it has one, and
// --weights-only does not leave it out. Unsupported for a state Megatron's
// Adam has no place for. Only the local spec's registration order is
// described, so the other keys' files get the weights only, with a note.
Result<bool> WritesOptimizer(const SourceCheckpoint& src, const ExportOptions& options, const MegatronExportPlan& plan,
                             std::atomic<int64_t>* read, std::vector<std::string>* notes) {
  if (options.weights_only) return false;
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all, src.FullTensors(options.replicated, read));
  RESHARD_RETURN_IF_ERROR(CheckFp32Masters(all, "megatron"));
  bool any = false;
  for (const FullTensor& t : all) {
    if (t.section != "optimizer") continue;
    any = true;
    if (t.state != kFp32Master && t.state != kTorchDistStates[1] && t.state != kTorchDistStates[2]) {
      return Status::Unsupported("export --to megatron: the optimizer state '" + t.state + "' of " + t.param +
                                 " has no place in Megatron-Core's distributed Adam state; export with --weights-only");
    }
  }
  // Transformer Engine's layers register the fused input norm after
  // linear_proj, not first as the local spec does: the order differs.
  if (any && plan.keys != Keys::kLocal) {
    notes->push_back("megatron: the optimizer state is not written: distrib_optim.pt's buffers follow the model's "
                     "registration order, which rule set " + plan.rules->name() + " gives for the local layer spec's "
                     "keys only (torch_dist.optimizer_order), not for the " +
                     (plan.keys == Keys::kLegacy ? "legacy GPTModel's" : "Transformer Engine spec's"));
    return false;
  }
  return any;
}

// The gradient dtype of a run's parameters of `dtype`: fp32, except fp16
// parameters without --accumulate-allreduce-grads-in-fp32 (bf16 runs always
// accumulate in fp32).
std::function<DType(DType)> GradDType(const std::optional<Value>& args) {
  const Value* fp32 = args ? Find(*args, "accumulate_allreduce_grads_in_fp32") : nullptr;
  const bool accumulate = fp32 != nullptr && fp32->is(Value::Kind::kBool) && fp32->as_bool();
  return [accumulate](DType dtype) { return dtype == DType::kFloat16 && !accumulate ? dtype : DType::kFloat32; };
}

// Each rank file's distrib_optim.pt: its parameters' pieces of the fp32
// masters and Adam's moments, cut for the target TP exactly as the weights.
Status PlanDistribOptim(const SourceCheckpoint& src, const MegatronExportPlan& plan, const TpWeights& weights,
                        int dp, std::atomic<int64_t>* read, std::vector<std::string>* notes, OutputPlan* out) {
  RESHARD_ASSIGN_OR_RETURN(const AdamStates states, CutAdamStates(src, plan.cut, read));
  const std::function<DType(DType)> grad_dtype = GradDType(plan.args);
  for (const MegatronFile& f : plan.files) {
    std::vector<RankParamState> params;
    for (const FileTensor& t : f.tensors) {
      const RankTensor& r = weights.ranks[f.tp_rank][t.source];
      RankParamState p{{Join(t.path, "."), WrittenDType(r, plan.dtype), ShapeNumel(r.shape), IsTiedVocab(r) && plan.pp > 1,
                        t.chunk}, {}};
      for (size_t s = 0; s < states.size(); ++s) {
        RESHARD_ASSIGN_OR_RETURN(Fp32Piece piece, Fp32StateOf(states, f.tp_rank, r.name, s));
        p.states[s] = std::move(piece.bytes);
      }
      params.push_back(std::move(p));
    }
    RESHARD_ASSIGN_OR_RETURN(Value state, DistribOptimValue(*plan.layout, f.pp_rank, plan.pipeline.stages,
                                                            std::move(params), dp, grad_dtype));
    const std::string name = f.name.substr(0, f.name.rfind('/') + 1) + kDistribOptimFile;
    RESHARD_ASSIGN_OR_RETURN(PlannedFile file,
                             TorchFile(name, "the distributed optimizer's state of stage " + std::to_string(f.pp_rank) +
                                                 ", TP rank " + std::to_string(f.tp_rank), std::move(state)));
    SetUnsaidFrom(&file, "", "the " + Count(static_cast<int64_t>(f.tensors.size()), "parameter") +
                                 " of model_optim_rng.pt, cut for TP as their weights, in Megatron's buffer order");
    out->files.push_back(std::move(file));
  }
  notes->push_back("megatron: the distributed optimizer's state in distrib_optim.pt beside each model_optim_rng.pt "
                   "(fp32 masters, exp_avg, exp_avg_sq; the same file at any DP); load with "
                   "--use-distributed-optimizer --ckpt-format torch --no-load-rng");
  return Status::Ok();
}

// model_optim_rng.pt's optimizer entries: DistributedOptimizer.state_dict()'s
// param groups, and the source's learning-rate scheduler, which Megatron-LM
// reads with the optimizer.
Status PlanOptimizerEntries(const SourceCheckpoint& src, MegatronExportPlan* plan, std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_ASSIGN_OR_RETURN(
      Value param_groups,
      MegatronParamGroups(groups, RunLrSchedule(src.info().metadata, src.info().settings), "0.19", notes));
  plan->optimizer = Value::MakeDict({{Value::String("optimizer"),
                                      Value::MakeDict({{Value::String("param_groups"), std::move(param_groups)}})}});
  const Value* scheduler = Find(src.info().metadata, "lr_scheduler");
  if (scheduler != nullptr && DictItems(*scheduler) != nullptr && !DictItems(*scheduler)->empty()) {
    plan->lr_scheduler = *scheduler;
  } else {
    notes->push_back("megatron: the source records no learning-rate scheduler state, and Megatron-LM's load of the "
                     "optimizer state reads one (opt_param_scheduler): it loads these files with --no-load-optim "
                     "(or --finetune) only");
  }
  return Status::Ok();
}

const char* KeysName(Keys keys) {
  switch (keys) {
    case Keys::kLegacy: return "legacy GPTModel keys";
    case Keys::kLocal: return "Megatron-Core GPTModel keys, local layer spec";
    case Keys::kTransformerEngine: return "Megatron-Core GPTModel keys, Transformer Engine layer spec";
  }
  return "";
}

// The Megatron-LM flag that builds the model whose keys the files hold.
const char* LoadFlag(Keys keys) {
  switch (keys) {
    case Keys::kLegacy: return "--use-legacy-models (Megatron-LM <= 0.17)";
    case Keys::kLocal: return "--transformer-impl local";
    case Keys::kTransformerEngine: return "--transformer-impl transformer_engine";
  }
  return "";
}

std::string Summary(const MegatronExportPlan& plan) {
  const int vpp = plan.pipeline.vpp();
  std::string out = "megatron (" + std::string(KeysName(plan.keys)) + "): TP " + std::to_string(plan.cut.tp) + ", PP " +
                    std::to_string(plan.pp) + (vpp > 1 ? ", VPP " + std::to_string(vpp) : std::string()) +
                    ", iteration " + std::to_string(plan.iteration) + "; " +
                    plan.pipeline.stages.Describe();
  if (plan.padded_vocab > 0) out += "; padded vocabulary " + std::to_string(plan.padded_vocab);
  return out + "\n";
}

Result<OutputPlan> PlanMegatron(const SourceCheckpoint& src, const ExportOptions& options,
                                std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckSource(src));
  MegatronExportPlan plan;
  RESHARD_ASSIGN_OR_RETURN(plan.cut, CutOf(options));
  RESHARD_RETURN_IF_ERROR(ChooseKeys(src, options, &plan, notes));
  RESHARD_ASSIGN_OR_RETURN(plan.dtype, ExportDType(FormatOption(options, "dtype")));
  plan.pp = options.pp;
  plan.iteration = src.info().iteration;
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(TpWeights weights, src.WeightsForTp(plan.cut, notes, out.read.get()));
  plan.padded_vocab = weights.padded_vocab;
  RESHARD_ASSIGN_OR_RETURN(plan.pipeline,
                           ChooseTargetPipeline(src, options, CountBlocks(weights.ranks[0]), plan.pp, notes));
  RESHARD_RETURN_IF_ERROR(PlaceTensors(weights, &plan));
  RESHARD_RETURN_IF_ERROR(AddExtraStates(&plan));
  const Value* args = Find(src.info().metadata, "args");
  const int dp = options.dp > 0 ? options.dp : SourceDp(src);
  if (args != nullptr && DictItems(*args) != nullptr) {
    MegatronLayout layout{plan.cut.tp, plan.pp, dp, plan.padded_vocab,
                          src.info().rules ? std::optional<bool>(TiesEmbedding(*src.info().rules)) : std::nullopt,
                          KvGroups(src.info().metadata, src.info().settings), plan.pipeline.split,
                          plan.pipeline.vpp(), {}, {}};
    ReadBiases(weights.ranks[0], &layout);
    plan.args = MegatronArgs(*args, layout, notes);
    WriteLrSchedule(RunLrSchedule(src.info().metadata, src.info().settings), &*plan.args);
  } else {
    notes->push_back("args: the source records no Megatron args, so the files have none (Megatron-LM then "
                     "skips its checks of the checkpoint's arguments)");
  }
  notes->push_back("megatron: " + std::string(KeysName(plan.keys)) + "; load with " + LoadFlag(plan.keys));
  if (std::string note = PipelineLoadNote("megatron", plan.pipeline); !note.empty()) notes->push_back(note);
  RESHARD_ASSIGN_OR_RETURN(const bool optimizer, WritesOptimizer(src, options, plan, out.read.get(), notes));
  if (optimizer) {
    RESHARD_RETURN_IF_ERROR(PlanOptimizerEntries(src, &plan, notes));
    RESHARD_RETURN_IF_ERROR(PlanDistribOptim(src, plan, weights, dp, out.read.get(), notes, &out));
  } else {
    notes->push_back("megatron: weights only, no optimizer or RNG state; load with --no-load-optim --no-load-rng "
                     "(or --finetune, which also restarts the iteration count)");
  }
  out.summary = Summary(plan);
  for (const MegatronFile& f : plan.files) {
    RESHARD_ASSIGN_OR_RETURN(PlannedFile file, PlanFile(plan, f, weights.ranks[f.tp_rank]));
    out.files.push_back(std::move(file));
  }
  out.files.push_back(TextFile(kLatestIterationFile, std::to_string(plan.iteration)));
  return out;
}

}  // namespace

TargetFormat MegatronTarget() {
  TargetFormatInfo info{"megatron", "NVIDIA Megatron-LM's torch checkpoint at --tp / --pp",
                        "the root holding iter_N/ and latest_checkpointed_iteration.txt"};
  info.tp = info.pp = info.dp = true;
  info.options = {{kLayerSpec, FormatOptionInfo::Kind::kText,
                   "The keys of Megatron-Core's GPTModel with the local or Transformer Engine (te) layer spec, or of "
                   "the legacy GPTModel (legacy, --use-legacy-models); default: local where the rule set names "
                   "Megatron-Core keys, else legacy",
                   {"local", "te", "legacy"}},
                  FromOption("weights"), DTypeOption()};
  for (FormatOptionInfo& o : PipelineSplitOptions()) info.options.push_back(std::move(o));
  return {std::move(info), PlanMegatron};
}

}  // namespace reshard
