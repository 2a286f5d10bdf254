#include "formats/megatron/torch_dist_export.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "container/dcp_writer.h"
#include "formats/megatron/megatron_args.h"
#include "formats/megatron/megatron_layout.h"
#include "formats/state_dict.h"
#include "logical/logical_checkpoint.h"
#include "logical/tp_placement.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";

constexpr char kMetadataJson[] = "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1}";
// How Megatron-Core names the item of a sharded object: shard `i` of `n`.
constexpr char kCommonState[] = "common_state/shard_0_1";
// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;
// The optimizer layout written: every state shaped like its model key.
constexpr char kFullyReshardable[] = "fully_reshardable";

std::string IterationFolder(int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

// The torch_dist key of a canonical tensor, and its layer in a stacked key.
struct KeyOf {
  std::string key;
  int block = -1;  // -1: the key is not stacked
};

// The block `name` is of in `pattern` ("layers.{block}.x"): -1 when it does not match.
int BlockOf(const std::string& pattern, const std::string& name) {
  const size_t at = pattern.find(kBlock);
  const size_t tail = pattern.size() - at - (sizeof(kBlock) - 1);
  if (name.size() <= at + tail || name.compare(0, at, pattern, 0, at) != 0 ||
      name.compare(name.size() - tail, tail, pattern, pattern.size() - tail, tail) != 0) {
    return -1;
  }
  const std::string digits = name.substr(at, name.size() - at - tail);
  if (digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

Result<KeyOf> FindKey(const RuleSet& rules, const std::string& name) {
  for (const TorchDistTensor& entry : rules.torch_dist()->tensors) {
    if (entry.name.find(kBlock) == std::string::npos) {
      if (entry.name == name) return KeyOf{entry.keys.front(), -1};
    } else if (const int block = BlockOf(entry.name, name); block >= 0) {
      return KeyOf{entry.keys.front(), block};
    }
  }
  return Status::Unsupported("export --to torch_dist: rule set " + rules.name() + "'s torch_dist section gives no "
                             "key for " + name + "; add an entry for it (docs/rules.md)");
}

// A stacked key's global size and a layer's chunk of it: the layer axis first.
std::vector<int64_t> StackedSize(const KeyOf& key, int blocks, std::vector<int64_t> size) {
  if (key.block >= 0) size.insert(size.begin(), blocks);
  return size;
}

DcpChunk StackedChunk(const KeyOf& key, DcpChunk chunk) {
  if (key.block >= 0) {
    chunk.offsets.insert(chunk.offsets.begin(), key.block);
    chunk.sizes.insert(chunk.sizes.begin(), 1);
  }
  return chunk;
}

// The global shape of a rank tensor's canonical tensor over `tp` ranks.
std::vector<int64_t> GlobalShape(const RankTensor& r, int tp) {
  std::vector<int64_t> shape = r.shape;
  if (r.rule->policy != ParamRule::Policy::kReplicated) shape[r.rule->dim] *= tp;
  return shape;
}

// One box of a rank tensor in the canonical tensor, and where its bytes
// start in the rank tensor's.
struct RankBox {
  DcpChunk chunk;
  int64_t byte_offset = 0;
};

// TP rank `t`'s boxes (logical/tp_placement.h): one, or one per
// sub-parameter (`parts`) of a split along dim 0, each contiguous in the
// rank tensor.
Result<std::vector<RankBox>> RankBoxes(const RankTensor& r, int t, int tp, DType dtype) {
  const TpPlacement place = PlaceTpRank(*r.rule, GlobalShape(r, tp), tp, t);
  if (place.placements.size() > 1 && r.rule->dim != 0) {
    return Status::Unsupported("export --to torch_dist: " + r.name + " stacks " + std::to_string(r.rule->parts) +
                               " sub-parameters along dim " + std::to_string(r.rule->dim) + ", whose pieces are "
                               "not contiguous in a rank's tensor; only dim 0 is supported");
  }
  const int64_t rows = r.shape.empty() ? 0 : r.shape[0];
  const int64_t row_bytes = rows == 0 ? 0 : ShapeNumel(r.shape) / rows * ElementSize(dtype);
  std::vector<RankBox> boxes;
  for (const Placement& p : place.placements) {
    boxes.push_back({DcpChunk{p.global.offsets, p.global.sizes}, p.local.empty() ? 0 : p.local[0] * row_bytes});
  }
  return boxes;
}

// Bytes [begin, begin + length) of `from`.
ByteProducer Window(ByteProducer from, int64_t begin) {
  return [from = std::move(from), begin](int64_t offset, int64_t length, uint8_t* dst) {
    return from(begin + offset, length, dst);
  };
}

struct Target {
  TpCut cut;
  int pp = 1;
  int blocks = 0, blocks_per_stage = 0;
  std::optional<DType> dtype;
};

int StageOf(const RankTensor& r, const Target& target) {
  if (r.block >= 0) return r.block / target.blocks_per_stage;
  return r.rule->role == "embedding" ? 0 : target.pp - 1;
}

// The items of TP rank `t`'s tensors, by stage.
Status AddRankItems(const RuleSet& rules, const std::vector<RankTensor>& tensors, int t, const Target& target,
                    std::vector<std::vector<DcpWriteItem>>* by_stage) {
  for (const RankTensor& r : tensors) {
    if (t > 0 && r.rule->policy == ParamRule::Policy::kReplicated) continue;  // TP rank 0 writes it
    RESHARD_ASSIGN_OR_RETURN(KeyOf key, FindKey(rules, r.name));
    const DType dtype = target.dtype && IsFloatingPoint(r.dtype) ? *target.dtype : r.dtype;
    RESHARD_ASSIGN_OR_RETURN(std::vector<RankBox> boxes, RankBoxes(r, t, target.cut.tp, dtype));
    const std::vector<int64_t> size = StackedSize(key, target.blocks, GlobalShape(r, target.cut.tp));
    const ByteProducer bytes = dtype == r.dtype ? r.produce : CastBytes(r.produce, r.dtype, dtype);
    for (RankBox& box : boxes) {
      (*by_stage)[StageOf(r, target)].push_back(
          DcpTensorItem(key.key, dtype, size, StackedChunk(key, std::move(box.chunk)), Window(bytes, box.byte_offset)));
    }
  }
  return Status::Ok();
}

// Each linear layer's extra state, empty, as Megatron-Core wraps an object:
// [None], item `shard_{layer}_{layers}`.
void AddExtraStates(const RuleSet& rules, const Target& target, std::vector<std::vector<DcpWriteItem>>* by_stage) {
  for (const std::string& module : rules.torch_dist()->extra_state) {
    for (int l = 0; l < target.blocks; ++l) {
      const std::string fqn = module + "._extra_state/shard_" + std::to_string(l) + "_" + std::to_string(target.blocks);
      (*by_stage)[l / target.blocks_per_stage].push_back(DcpBytesItem(fqn, Value::MakeList({Value::None()})));
    }
  }
}

// Megatron-Core's name of an optimizer state in `optimizer.state.<name>.<key>`.
Result<std::string> StateName(const FullTensor& t) {
  if (t.state == kFp32Master) return std::string("param");
  if (t.state == "exp_avg" || t.state == "exp_avg_sq") return t.state;
  return Status::Unsupported("export --to torch_dist: the optimizer state '" + t.state + "' of " + t.param +
                             " has no place in Megatron-Core's Adam state; export with --weights-only");
}

// `t` with `rows` rows: its own, cut or followed by zero rows (a vocabulary
// padded for another TP).
ByteProducer WithRows(const FullTensor& t, int64_t rows) {
  const int64_t row_bytes = ShapeNumel(t.shape) / t.shape[0] * ElementSize(t.dtype);
  const int64_t have = std::min(rows, t.shape[0]) * row_bytes;
  return [from = t.produce, have](int64_t offset, int64_t length, uint8_t* dst) {
    const int64_t own = std::clamp<int64_t>(have - offset, 0, length);
    if (own > 0) RESHARD_RETURN_IF_ERROR(from(offset, own, dst));
    std::fill(dst + own, dst + length, uint8_t{0});
    return Status::Ok();
  };
}

// The fully_reshardable layout: every state of every parameter whole under
// `optimizer.state.<state>.<key>`, fp32, shaped like the model key (a
// stacked key's layers one chunk each), written by TP rank 0 of the stage
// holding the weight. `weights` gives each parameter's key, stage and shape.
Status AddOptimizerItems(const RuleSet& rules, const std::vector<FullTensor>& states,
                         const std::vector<RankTensor>& weights, const Target& target,
                         std::vector<std::vector<DcpWriteItem>>* by_stage) {
  std::map<std::string, const RankTensor*> weight_of;
  for (const RankTensor& r : weights) weight_of[r.name] = &r;
  for (const FullTensor& t : states) {
    auto it = weight_of.find(t.param);
    if (it == weight_of.end()) return Status::Internal("optimizer state of " + t.param + ", which is no weight");
    const RankTensor& r = *it->second;
    RESHARD_ASSIGN_OR_RETURN(std::string state, StateName(t));
    RESHARD_ASSIGN_OR_RETURN(KeyOf key, FindKey(rules, t.param));
    const std::vector<int64_t> shape = GlobalShape(r, target.cut.tp);
    if (shape.empty() || shape.size() != t.shape.size() || !std::equal(shape.begin() + 1, shape.end(), t.shape.begin() + 1) ||
        (!t.vocab && shape[0] != t.shape[0])) {
      return Status::Internal("optimizer " + t.state + " of " + t.param + " is " + ShapeString(t.shape) +
                              ", its weight " + ShapeString(shape));
    }
    ByteProducer bytes = t.vocab ? WithRows(t, shape[0]) : t.produce;
    if (t.dtype != DType::kFloat32) bytes = CastBytes(std::move(bytes), t.dtype, DType::kFloat32);
    const DcpChunk chunk = StackedChunk(key, {std::vector<int64_t>(shape.size(), 0), shape});
    (*by_stage)[StageOf(r, target)].push_back(DcpTensorItem("optimizer.state." + state + "." + key.key,
                                                            DType::kFloat32, StackedSize(key, target.blocks, shape),
                                                            chunk, std::move(bytes)));
  }
  return Status::Ok();
}

// Megatron-Core records the step as a float in every group.
Result<Value> FloatStep(const std::optional<Value>& step) {
  if (!step) return Value::Float(0.0);
  if (step->is(Value::Kind::kFloat)) return *step;
  if (step->is(Value::Kind::kInt)) return Value::Float(static_cast<double>(step->as_int()));
  return Status::Unsupported("export --to torch_dist: the optimizer step " + step->DebugString(40) +
                             " is not a number; export with --weights-only");
}

// The value of hyperparameter `name`: the source's, else `fallback`; a
// list of betas becomes torch's tuple.
Value Hyper(const Value& hyper, const std::string& name, Value fallback) {
  const Value* v = Find(hyper, name);
  if (v == nullptr) return fallback;
  if (v->is(Value::Kind::kList)) return Value::MakeTuple(v->as_list().items);
  return *v;
}

// One Megatron-Core 0.19 param group (default config, no expert
// parallelism) from a source group's hyperparameters; max_lr and min_lr
// from the args where the source's group has none.
Value MegatronGroup(const OptimizerParamGroup& group, const Value& step, const Value* args) {
  const Value& h = group.hyperparameters;
  const Value* args_lr = args != nullptr ? Find(*args, "lr") : nullptr;
  const Value* args_min_lr = args != nullptr ? Find(*args, "min_lr") : nullptr;
  const Value lr = Hyper(h, "lr", Value::None());
  Value out = Value::MakeDict();
  Set(out, "is_expert_parallel", Value::Bool(false));
  Set(out, "default_config", Value::Bool(true));
  Set(out, "wd_mult", Value::Float(group.weight_decay_multiplier));
  Set(out, "lr_mult", Hyper(h, "lr_mult", Value::Float(1.0)));
  Set(out, "is_decoupled_lr", Value::Bool(false));
  Set(out, "max_lr", Hyper(h, "max_lr", args_lr != nullptr ? *args_lr : lr));
  Set(out, "min_lr", Hyper(h, "min_lr", args_min_lr != nullptr ? *args_min_lr : Value::None()));
  Set(out, "lr", lr);
  for (const char* name : {"betas", "eps", "weight_decay"}) Set(out, name, Hyper(h, name, Value::None()));
  for (const char* name : {"amsgrad", "maximize", "capturable", "differentiable"}) {
    Set(out, name, Hyper(h, name, Value::Bool(false)));
  }
  for (const char* name : {"foreach", "fused"}) Set(out, name, Hyper(h, name, Value::None()));
  Set(out, "step", step);
  return out;
}

// Megatron-Core makes one group per weight-decay multiplier, decayed first:
// source groups that share one (a split decay group) must agree.
Result<Value> MegatronParamGroups(const OptimizerParamGroups& groups, const Value* args) {
  RESHARD_ASSIGN_OR_RETURN(Value step, FloatStep(groups.step));
  std::map<double, const OptimizerParamGroup*, std::greater<double>> by_mult;
  for (const OptimizerParamGroup& g : groups.groups) {
    auto [it, fresh] = by_mult.emplace(g.weight_decay_multiplier, &g);
    if (!fresh && it->second->hyperparameters.DebugString(1 << 16) != g.hyperparameters.DebugString(1 << 16)) {
      return Status::Unsupported("export --to torch_dist: two optimizer groups with weight decay multiplier " +
                                 std::to_string(g.weight_decay_multiplier) + " differ in their hyperparameters, "
                                 "which Megatron-Core keeps in one group; export with --weights-only");
    }
  }
  std::vector<Value> out;
  for (const auto& [mult, g] : by_mult) out.push_back(MegatronGroup(*g, step, args));
  return Value::MakeList(std::move(out));
}

// Every state written belongs to a group, or Megatron-Core would not know its hyperparameters.
Status CheckGrouped(const OptimizerParamGroups& groups, const std::vector<FullTensor>& states) {
  std::set<std::string> grouped;
  for (const OptimizerParamGroup& g : groups.groups) grouped.insert(g.params.begin(), g.params.end());
  for (const FullTensor& t : states) {
    if (grouped.count(t.param) == 0) {
      return Status::Internal("optimizer state of " + t.param + ", which is in no optimizer group");
    }
  }
  return Status::Ok();
}

// The common state's `optimizer` entry, as Megatron-Core 0.19 writes it for fully_reshardable.
Result<Value> OptimizerCommonState(const SourceCheckpoint& src, const std::vector<FullTensor>& states) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_RETURN_IF_ERROR(CheckGrouped(groups, states));
  RESHARD_ASSIGN_OR_RETURN(Value param_groups, MegatronParamGroups(groups, Find(src.info().metadata, "args")));
  Value out = Value::MakeDict();
  Set(out, "optimizer", Value::MakeDict({{Value::String("param_groups"), std::move(param_groups)}}));
  Set(out, "param_state_sharding_type", Value::String(kFullyReshardable));
  return out;
}

// Megatron-Core 0.19's common state: what Megatron-LM's load reads before
// the tensors.
Value CommonState(const SourceCheckpoint& src, const Target& target, int64_t padded_vocab,
                  std::optional<Value> optimizer, std::vector<std::string>* notes) {
  Value state = Value::MakeDict();
  if (optimizer) Set(state, "optimizer", std::move(*optimizer));
  const Value* args = Find(src.info().metadata, "args");
  if (args != nullptr && DictItems(*args) != nullptr) {
    Value written = MegatronArgs(*args, {target.cut.tp, target.pp, 1, padded_vocab}, notes);
    // The true vocabulary size, as Megatron-LM's --vocab-size records it: what
    // re-padding for another TP needs.
    const std::optional<int64_t> vocab = target.cut.vocab_size ? target.cut.vocab_size : src.info().vocab_size;
    if (vocab) Set(written, "vocab_size", Value::Int(*vocab));
    Set(state, "args", std::move(written));
  }
  Set(state, "checkpoint_version", Value::Float(3.0));
  Set(state, "iteration", Value::Int(src.info().iteration));
  return Value::MakeList({std::move(state)});
}

Status CheckSource(const SourceCheckpoint& src, const ExportOptions& options) {
  const std::shared_ptr<const RuleSet>& rules = src.info().rules;
  if (rules == nullptr || rules->torch_dist() == nullptr) {
    return Status::Unsupported("export --to torch_dist writes the keys a rule set's torch_dist section names, and " +
                               (rules == nullptr ? "this " + src.info().kind + " checkpoint is read without a rule set"
                                                 : "rule set " + rules->name() + " has none") +
                               "; export --to consolidated writes its tensors");
  }
  if (options.tp < 1 || options.pp < 1) {
    return Status::InvalidInput("export --to torch_dist needs the target layout: --tp N and --pp N (both >= 1)");
  }
  if (!options.optimizer_layout.empty() && options.optimizer_layout != kFullyReshardable) {
    return Status::InvalidInput("unknown --optimizer-layout '" + options.optimizer_layout + "'; use " +
                                kFullyReshardable);
  }
  if (!options.optimizer_layout.empty() && options.weights_only) {
    return Status::InvalidInput("--weights-only leaves the optimizer state out, which --optimizer-layout lays out; "
                                "give one of them");
  }
  if (!options.from.empty() && options.from != "weights" && options.from != "masters") {
    return Status::InvalidInput("unknown --from '" + options.from + "'; use weights or masters");
  }
  return Status::Ok();
}

// The optimizer states to write: every one the source has, unless
// --weights-only leaves them out.
Result<std::vector<FullTensor>> OptimizerStates(const SourceCheckpoint& src, const ExportOptions& options,
                                                std::atomic<int64_t>* read) {
  std::vector<FullTensor> states;
  if (options.weights_only) return states;
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all, src.FullTensors(options.replicated, read));
  for (FullTensor& t : all) {
    if (t.section == "optimizer") states.push_back(std::move(t));
  }
  if (states.empty() && !options.optimizer_layout.empty()) {
    return Status::InvalidInput("--optimizer-layout: the source has no optimizer state; drop the option");
  }
  return states;
}

int CountBlocks(const std::vector<RankTensor>& tensors) {
  int blocks = 0;
  for (const RankTensor& t : tensors) blocks = std::max(blocks, t.block + 1);
  return blocks;
}

}  // namespace

Result<OutputPlan> PlanTorchDist(const SourceCheckpoint& src, const ExportOptions& options,
                                 std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckSource(src, options));
  const RuleSet& rules = *src.info().rules;
  Target target;
  target.cut = TpCut{options.tp, options.replicated, options.vocab_size, options.from == "masters"};
  target.pp = options.pp;
  RESHARD_ASSIGN_OR_RETURN(target.dtype, ExportDType(options.dtype));
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(TpWeights weights, src.WeightsForTp(target.cut, notes, out.read.get()));
  target.blocks = CountBlocks(weights.ranks[0]);
  RESHARD_ASSIGN_OR_RETURN(target.blocks_per_stage, BlocksPerStage(target.blocks, target.pp));

  std::vector<std::vector<std::vector<DcpWriteItem>>> items(
      options.tp, std::vector<std::vector<DcpWriteItem>>(target.pp));  // [TP rank][stage]
  for (int t = 0; t < options.tp; ++t) {
    RESHARD_RETURN_IF_ERROR(AddRankItems(rules, weights.ranks[t], t, target, &items[t]));
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> states, OptimizerStates(src, options, out.read.get()));
  std::optional<Value> optimizer;
  if (!states.empty()) {
    RESHARD_RETURN_IF_ERROR(AddOptimizerItems(rules, states, weights.ranks[0], target, &items[0]));
    RESHARD_ASSIGN_OR_RETURN(optimizer, OptimizerCommonState(src, states));
  }
  AddExtraStates(rules, target, &items[0]);
  items[0][0].push_back(
      DcpBytesItem(kCommonState, CommonState(src, target, weights.padded_vocab, std::move(optimizer), notes)));

  const std::string folder = IterationFolder(src.info().iteration);
  for (int p = 0; p < target.pp; ++p) {
    for (int t = 0; t < options.tp; ++t) {
      const int rank = p * options.tp + t;
      RESHARD_ASSIGN_OR_RETURN(DcpFileLayout layout,
                               LayOutDcpFile("__" + std::to_string(rank) + "_0.distcp", std::move(items[t][p])));
      out.files.push_back(DcpDataFile(folder, "stage " + std::to_string(p) + ", TP rank " + std::to_string(t),
                                      std::move(layout), kPartBytes));
    }
  }
  std::vector<const PlannedFile*> data;
  for (const PlannedFile& f : out.files) data.push_back(&f);
  RESHARD_ASSIGN_OR_RETURN(PlannedFile metadata, DcpMetadataFile(folder, data));
  out.files.push_back(std::move(metadata));
  out.files.push_back(TextFile(folder + "/metadata.json", kMetadataJson));
  out.files.push_back(TextFile(kLatestIterationFile, std::to_string(src.info().iteration)));
  out.summary = "torch_dist: TP " + std::to_string(options.tp) + ", PP " + std::to_string(target.pp) +
                ", iteration " + std::to_string(src.info().iteration) + "; " +
                Count(target.blocks, "block") + ", stacked; padded vocabulary " +
                std::to_string(weights.padded_vocab) +
                (states.empty() ? "; weights only" : "; optimizer state fully_reshardable") + "\n";
  notes->push_back(states.empty() ? "torch_dist: weights only, no optimizer or RNG state; load with --no-load-optim "
                                    "--no-load-rng (or --finetune, which also restarts the iteration count)"
                                  : "torch_dist: the optimizer state as fully_reshardable (load with "
                                    "--dist-ckpt-optim-fully-reshardable), no RNG state (load with --no-load-rng)");
  return out;
}

}  // namespace reshard
