#include "formats/megatron_core/torch_dist/torch_dist_export.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include "container/dcp_writer.h"
#include "formats/megatron_core/common/adam_states.h"
#include "formats/megatron_core/common/expert_optimizers.h"
#include "formats/megatron_core/common/megatron_args.h"
#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/megatron_param_groups.h"
#include "formats/megatron_core/common/megatron_scheduler.h"
#include "formats/megatron_core/common/nd_reformulation.h"
#include "formats/megatron_core/common/optimizer_layouts.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "formats/megatron_core/torch_dist/dp_reshardable_items.h"
#include "formats/state_dict.h"
#include "logical/logical_checkpoint.h"
#include "logical/tp_placement.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// The options that choose the form written.
constexpr char kLayoutOption[] = "optimizer-layout";
constexpr char kVersionOption[] = "megatron-core-version";
constexpr char kBucketSizeOption[] = "ddp-bucket-size";

// The Megatron-Core versions whose forms are written: 0.19 keeps the common
// state in a bytes item, 0.14 in common.pt, which metadata.json names.
constexpr char kVersion014[] = "0.14";
constexpr char kVersion019[] = "0.19";
constexpr char kMetadataJson[] = "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1}";
constexpr char kMetadataJson014[] =
    "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1, \"common_backend\": \"torch\", "
    "\"common_backend_version\": 1}";
// How Megatron-Core names the item of a sharded object: shard `i` of `n`.
constexpr char kCommonState[] = "common_state/shard_0_1";
constexpr char kCommonFile[] = "common.pt";
// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;

std::string IterationFolder(int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

// The torch_dist key of a canonical tensor, and its layer (and expert) in a
// stacked key.
struct KeyOf {
  std::string key;
  int block = -1;   // -1: the key is not stacked
  int expert = -1;  // -1: the key stacks no experts
};

// The torch_dist key of rank tensor `r`: what current Megatron-Core names it.
Result<KeyOf> KeyOfTensor(const RuleSet& rules, const RankTensor& r) {
  RESHARD_ASSIGN_OR_RETURN(const TorchDistTensor* entry, TorchDistEntryOf(rules, r, "torch_dist"));
  return KeyOf{entry->keys.front(), r.block, ExpertOf(r)};
}

// A stacked key's global size and a layer's (an expert's) chunk of it: the
// layer axis first, then the expert axis.
std::vector<int64_t> StackedSize(const KeyOf& key, int blocks, int experts, std::vector<int64_t> size) {
  if (key.expert >= 0) size.insert(size.begin(), experts);
  if (key.block >= 0) size.insert(size.begin(), blocks);
  return size;
}

Box StackedChunk(const KeyOf& key, Box chunk) {
  for (const int at : {key.expert, key.block}) {
    if (at < 0) continue;
    chunk.offsets.insert(chunk.offsets.begin(), at);
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

// TP rank `t`'s pieces of the canonical tensor (logical/tp_placement.h): one,
// or one per sub-parameter (`parts`) of a split along dim 0, each contiguous
// in the rank tensor.
Result<std::vector<Placement>> RankPieces(const RankTensor& r, int t, int tp) {
  TpPlacement place = PlaceTpRank(*r.rule, GlobalShape(r, tp), tp, t);
  if (place.placements.size() > 1 && r.rule->dim != 0) {
    return Status::Unsupported("export --to torch_dist: " + r.name + " stacks " + std::to_string(r.rule->parts) +
                               " sub-parameters along dim " + std::to_string(r.rule->dim) + ", whose pieces are "
                               "not contiguous in a rank's tensor; only dim 0 is supported");
  }
  return std::move(place.placements);
}

// Where `piece` starts in the bytes of rank tensor `r` held as `dtype`.
int64_t ByteOffsetOf(const Placement& piece, const RankTensor& r, DType dtype) {
  if (piece.local.empty() || r.shape.empty() || r.shape[0] == 0) return 0;
  return piece.local[0] * (ShapeNumel(r.shape) / r.shape[0]) * ElementSize(dtype);
}

struct Target {
  TpCut cut;
  int pp = 1, dp = 1;
  int blocks = 0;
  int experts = 0;          // of each MoE layer; 0: none
  int ep = 1;               // the experts' expert-parallel size
  TargetPipeline pipeline;  // the layers of each stage
  std::optional<DType> dtype;
  std::string version;                 // kVersion014 or kVersion019
  std::string layout;                  // of the optimizer state
  std::optional<int64_t> bucket_size;  // dp_reshardable's, on the first stage's first model chunk
};

// The items of every rank's `.distcp` file.
class RankFiles {
 public:
  explicit RankFiles(const Target& target)
      : tp_(target.cut.tp), dp_(target.dp), items_(target.cut.tp * target.dp * target.pp) {}

  // Megatron's default rank order: TP fastest, then DP, then PP.
  static int Rank(int tp_rank, int pp_rank, int dp_rank, int tp, int dp) { return tp_rank + tp * (dp_rank + dp * pp_rank); }
  std::vector<DcpWriteItem>& At(int tp_rank, int pp_rank, int dp_rank = 0) {
    return items_[Rank(tp_rank, pp_rank, dp_rank, tp_, dp_)];
  }
  std::vector<std::vector<DcpWriteItem>>& all() { return items_; }

 private:
  int tp_, dp_;
  std::vector<std::vector<DcpWriteItem>> items_;  // by rank
};

// The DP rank whose files hold expert `e`'s pieces. Megatron-Core numbers
// the expert ranks TP fastest (the experts' TP is the dense layers'), then
// EP, then expert DP, then PP: a stage's ranks of DP rank d hold EP rank
// d % EP's experts, as expert-DP replica d / EP, and replica 0 writes them.
int ExpertDpRank(const Target& target, int expert) { return expert / (target.experts / target.ep); }

// The DP rank that writes a tensor of key `key`: 0, or its expert's.
int WritingDpRank(const KeyOf& key, const Target& target) {
  return key.expert >= 0 ? ExpertDpRank(target, key.expert) : 0;
}

int StageOf(const RankTensor& r, const Target& target) {
  if (r.block >= 0) return target.pipeline.stages.StageOf(r.block);
  return r.rule->role == "embedding" ? 0 : target.pp - 1;
}

// The items of TP rank `t`'s tensors.
Status AddRankItems(const RuleSet& rules, const std::vector<RankTensor>& tensors, int t, const Target& target,
                    RankFiles* files) {
  for (const RankTensor& r : tensors) {
    if (t > 0 && r.rule->policy == ParamRule::Policy::kReplicated) continue;  // TP rank 0 writes it
    RESHARD_ASSIGN_OR_RETURN(KeyOf key, KeyOfTensor(rules, r));
    const DType dtype = WrittenDType(r, target.dtype);
    RESHARD_ASSIGN_OR_RETURN(std::vector<Placement> pieces, RankPieces(r, t, target.cut.tp));
    const std::vector<int64_t> size = StackedSize(key, target.blocks, target.experts, GlobalShape(r, target.cut.tp));
    const ByteProducer bytes = dtype == r.dtype ? r.produce : CastBytes(r.produce, r.dtype, dtype);
    for (Placement& piece : pieces) {
      const int64_t at = ByteOffsetOf(piece, r, dtype);
      DcpWriteItem item =
          DcpTensorItem(key.key, dtype, size, StackedChunk(key, std::move(piece.global)), BytesFrom(bytes, at));
      item.from = r.Label();
      files->At(t, StageOf(r, target), WritingDpRank(key, target)).push_back(std::move(item));
    }
  }
  return Status::Ok();
}

// Each linear layer's extra state, empty, as Megatron-Core wraps an object:
// [None], item `shard_{layer}_{layers}`; an expert's `shard_{layer}.{expert}_
// {layers}.{experts}`, written with the expert's weights (by its EP rank).
void AddExtraStates(const RuleSet& rules, const Target& target, RankFiles* files) {
  const std::string layers = std::to_string(target.blocks), experts = std::to_string(target.experts);
  for (int l = 0; l < target.blocks; ++l) {
    const int stage = target.pipeline.stages.StageOf(l);
    for (const std::string& module : rules.section<TorchDistLayout>()->extra_state) {
      files->At(0, stage).push_back(DcpBytesItem(module + "._extra_state/shard_" + std::to_string(l) + "_" + layers,
                                                 Value::MakeList({Value::None()})));
    }
    for (int e = 0; e < target.experts; ++e) {
      for (const std::string& module : rules.section<TorchDistLayout>()->expert_extra_state) {
        const std::string shard = std::to_string(l) + "." + std::to_string(e) + "_" + layers + "." + experts;
        files->At(0, stage, ExpertDpRank(target, e))
            .push_back(DcpBytesItem(module + "._extra_state/shard_" + shard, Value::MakeList({Value::None()})));
      }
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
  return ByteProducer::Traced([from = t.produce, have](int64_t offset, int64_t length, uint8_t* dst,
                                                       const SpanSink& spans) {
    const int64_t own = std::clamp<int64_t>(have - offset, 0, length);
    if (own > 0) RESHARD_RETURN_IF_ERROR(from(offset, own, dst, spans));
    std::fill(dst + own, dst + length, uint8_t{0});
    return Status::Ok();
  });
}

// The fully_reshardable layout: every state of every parameter whole under
// `optimizer.state.<state>.<key>`, fp32, shaped like the model key (a
// stacked key's layers, and experts, one chunk each), written by TP rank 0
// of the stage holding the weight, in the file of the DP rank that writes
// the weight (an expert's by its EP rank's). `weights` gives each
// parameter's key, stage and shape.
Status AddOptimizerItems(const RuleSet& rules, const std::vector<FullTensor>& states,
                         const std::vector<RankTensor>& weights, const Target& target, RankFiles* files) {
  std::map<std::string, const RankTensor*> weight_of;
  for (const RankTensor& r : weights) weight_of[r.name] = &r;
  for (const FullTensor& t : states) {
    auto it = weight_of.find(t.param);
    if (it == weight_of.end()) return Status::Internal("optimizer state of " + t.param + ", which is no weight");
    const RankTensor& r = *it->second;
    RESHARD_ASSIGN_OR_RETURN(std::string state, StateName(t));
    RESHARD_ASSIGN_OR_RETURN(KeyOf key, KeyOfTensor(rules, r));
    const std::vector<int64_t> shape = GlobalShape(r, target.cut.tp);
    if (shape.empty() || shape.size() != t.shape.size() || !std::equal(shape.begin() + 1, shape.end(), t.shape.begin() + 1) ||
        (!t.vocab && shape[0] != t.shape[0])) {
      return Status::Internal("optimizer " + t.state + " of " + t.param + " is " + ShapeString(t.shape) +
                              ", its weight " + ShapeString(shape));
    }
    ByteProducer bytes = t.vocab ? WithRows(t, shape[0]) : t.produce;
    if (t.dtype != DType::kFloat32) bytes = CastBytes(std::move(bytes), t.dtype, DType::kFloat32);
    const Box chunk = StackedChunk(key, Box::Whole(shape));
    DcpWriteItem item = DcpTensorItem("optimizer.state." + state + "." + key.key, DType::kFloat32,
                                      StackedSize(key, target.blocks, target.experts, shape), chunk, std::move(bytes));
    item.from = t.Label();
    if (t.vocab && shape[0] != t.shape[0]) item.from += ", rows to " + std::to_string(shape[0]);
    files->At(0, StageOf(r, target), WritingDpRank(key, target)).push_back(std::move(item));
  }
  return Status::Ok();
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

// A parameter of a stage by its torch_dist key, layer and expert (-1 for none).
using StageKey = std::tuple<std::string, int64_t, int64_t>;

// Whether the optimizer of `share` holds a parameter of expert `expert`
// (-1: of none).
bool Holds(const OptimizerShare& share, int expert) {
  return expert < 0 ? share.dense : expert >= share.first_expert && expert < share.first_expert + share.experts;
}

// TP rank `t`'s tensors of stage `p` that the optimizer of `share` holds;
// at PP > 1 the tied embedding also as the last stage's tied head.
Result<std::map<StageKey, const RankTensor*>> StageTensors(const RuleSet& rules, const TpWeights& weights, int t,
                                                           int p, const Target& target, const OptimizerShare& share) {
  std::map<StageKey, const RankTensor*> by_key;
  for (const RankTensor& r : weights.ranks[t]) {
    if (!Holds(share, ExpertOf(r))) continue;
    if (IsTiedVocab(r) && target.pp > 1 && p == target.pp - 1) {
      if (rules.section<TorchDistLayout>()->tied_head.empty()) {
        return Status::Unsupported("export --to torch_dist: rule set " + rules.name() + " ties the embedding, and its "
                                   "torch_dist section names no tied_head, the last stage's copy the dp_reshardable "
                                   "buckets hold at PP > 1; add one (docs/rules.md) or use --optimizer-layout "
                                   "fully_reshardable");
      }
      by_key[{rules.section<TorchDistLayout>()->tied_head, -1, -1}] = &r;
    }
    if (StageOf(r, target) != p) continue;
    RESHARD_ASSIGN_OR_RETURN(KeyOf key, KeyOfTensor(rules, r));
    by_key[{key.key, r.block, key.expert}] = &r;
  }
  return by_key;
}

// The stage's parameters of TP rank `t` that the optimizer of `share`
// holds, in registration order, model chunk by model chunk, each with its
// pieces of the states (`states`: the source's fp32 masters, exp_avg and
// exp_avg_sq cut like `weights`).
Result<std::vector<DpParam>> StageParams(const RuleSet& rules, const TpWeights& weights, const AdamStates& states,
                                         int t, int p, const Target& target, const OptimizerShare& share) {
  RESHARD_ASSIGN_OR_RETURN(auto by_key, StageTensors(rules, weights, t, p, target, share));
  const TorchDistLayout& layout = *rules.section<TorchDistLayout>();
  std::vector<DpParam> params;
  for (int c = 0; c < target.pipeline.vpp(); ++c) {
    for (const RegisteredParam& reg :
         ChunkRegistrationOrder(layout, target.pipeline.stages, p, c, layout.tied_head, share)) {
      auto it = by_key.find({reg.key, reg.layer, reg.expert});
      if (it == by_key.end()) continue;
      const RankTensor& r = *it->second;
      DpParam param{reg.key, WrittenDType(r, target.dtype), ShapeNumel(r.shape), IsTiedVocab(r) && target.pp > 1, c,
                    {}, {}};
      for (size_t s = 0; s < states.size(); ++s) {
        RESHARD_ASSIGN_OR_RETURN(Fp32Piece piece, Fp32StateOf(states, t, r.name, s));
        param.states[s] = std::move(piece.bytes);
        param.from[s] = std::move(piece.from);
      }
      params.push_back(std::move(param));
      by_key.erase(it);
    }
  }
  if (!by_key.empty()) {
    return Status::Unsupported("export --to torch_dist: " + std::get<0>(by_key.begin()->first) +
                               " is not in rule set " + rules.name() +
                               "'s torch_dist.optimizer_order, the registration order dp_reshardable "
                               "buffers follow; add it (docs/rules.md) or use --optimizer-layout fully_reshardable");
  }
  return params;
}

// One optimizer's model-parallel rank whose dp_reshardable items are
// written: its items' group, the parameters it holds of its TP rank and
// stage, and its buffers' DP ranks: `dp` of them, share d written by DP
// rank first_dp_rank + dp_stride · d.
struct DpRank {
  MegatronDpGroup group;
  int tp_rank = 0, pp_rank = 0;
  OptimizerShare share;
  int dp = 1;
  int first_dp_rank = 0, dp_stride = 1;
};

// The model-parallel ranks of each optimizer Megatron-Core builds at the
// target's EP: the dense parameters' (at EP 1 every parameter's) at each
// (TP rank, stage) over the DP ranks; at EP > 1 the experts' at each (TP
// rank, EP rank, stage), holding the EP rank's experts, over the
// expert-data-parallel ranks: expert-DP rank r of EP rank e is DP rank
// e + EP · r (ExpertDpRank).
std::vector<DpRank> DpRanks(const Target& target, bool chained) {
  const int tp = target.cut.tp;
  std::vector<DpRank> ranks;
  for (int p = 0; p < target.pp; ++p) {
    for (int t = 0; t < tp; ++t) {
      ranks.push_back({{MegatronDpGroupIdx(t, p, tp), chained ? 0 : -1}, t, p,
                       {true, 0, chained ? 0 : target.experts}, target.dp, 0, 1});
    }
  }
  if (!chained) return ranks;
  const int local = target.experts / target.ep;
  for (int p = 0; p < target.pp; ++p) {
    for (int e = 0; e < target.ep; ++e) {
      for (int t = 0; t < tp; ++t) {
        ranks.push_back({{MegatronExpertDpGroupIdx(t, e, p, tp, target.ep), 1}, t, p, {false, e * local, local},
                         target.dp / target.ep, e, target.ep});
      }
    }
  }
  return ranks;
}

// The dp_reshardable layout: each model-parallel rank's buckets of each
// optimizer (dp_reshardable_items.h) from its pieces of every state, cut for
// the target TP exactly as its weights; `per_optimizer` the param groups of
// each (ParamGroupsPerOptimizer).
Status AddDpReshardableItems(const SourceCheckpoint& src, const TpWeights& weights,
                             const std::vector<Value>& per_optimizer, const Target& target,
                             std::atomic<int64_t>* read, RankFiles* files) {
  const RuleSet& rules = *src.info().rules;
  RESHARD_ASSIGN_OR_RETURN(const AdamStates states, CutAdamStates(src, target.cut, read));
  for (const DpRank& rank : DpRanks(target, per_optimizer.size() > 1)) {
    // Megatron-Core's DistributedDataParallel cuts buckets on the first stage only.
    const std::optional<int64_t> bucket_size = rank.pp_rank == 0 ? target.bucket_size : std::nullopt;
    RESHARD_ASSIGN_OR_RETURN(std::vector<DpParam> params,
                             StageParams(rules, weights, states, rank.tp_rank, rank.pp_rank, target, rank.share));
    RESHARD_ASSIGN_OR_RETURN(
        std::vector<std::vector<DcpWriteItem>> items,
        DpReshardableItems(rank.group, params, {rank.dp, bucket_size}, per_optimizer[std::max(rank.group.chained, 0)]));
    for (int d = 0; d < rank.dp; ++d) {
      std::vector<DcpWriteItem>& file = files->At(rank.tp_rank, rank.pp_rank, rank.first_dp_rank + rank.dp_stride * d);
      std::move(items[d].begin(), items[d].end(), std::back_inserter(file));
    }
  }
  return Status::Ok();
}

// The fully_sharded_model_space layout of Megatron-Core 0.14: each state
// of each parameter under `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.
// <key>`, reformulated (formats/megatron_core/common/nd_reformulation.h): each box a TP rank
// writes of the weight (a layer's piece) is one fragment, flattened, written
// by the rank that writes the weight's box (TP rank 0 alone for a
// replicated tensor). Megatron-Core cuts a fragment at its DP ranks' shard
// bounds; here DP rank 0 writes each whole, which loads the same.
Status AddModelSpaceItems(const SourceCheckpoint& src, const TpWeights& weights, const Target& target,
                          std::atomic<int64_t>* read, RankFiles* files) {
  const RuleSet& rules = *src.info().rules;
  RESHARD_ASSIGN_OR_RETURN(const AdamStates states, CutAdamStates(src, target.cut, read));
  for (int t = 0; t < target.cut.tp; ++t) {
    for (const RankTensor& r : weights.ranks[t]) {
      if (t > 0 && r.rule->policy == ParamRule::Policy::kReplicated) continue;  // TP rank 0 writes it
      RESHARD_ASSIGN_OR_RETURN(KeyOf key, KeyOfTensor(rules, r));
      const std::vector<int64_t> global = StackedSize(key, target.blocks, target.experts, GlobalShape(r, target.cut.tp));
      RESHARD_ASSIGN_OR_RETURN(std::vector<Placement> pieces, RankPieces(r, t, target.cut.tp));
      for (size_t s = 0; s < states.size(); ++s) {
        RESHARD_ASSIGN_OR_RETURN(Fp32Piece state, Fp32StateOf(states, t, r.name, s));
        // Megatron-Core 0.14 names the fp32 master `fp32_param`.
        const std::string fqn = std::string("optimizer.state.") + (s == 0 ? "fp32_param" : kTorchDistStates[s]) + "." + key.key;
        for (const Placement& rank_piece : pieces) {
          const Box piece = StackedChunk(key, rank_piece.global);
          RESHARD_ASSIGN_OR_RETURN(NdReformulation reform, NdReformulationOf(global, piece.sizes, fqn));
          Box row{reform.FragmentIndex(piece), std::vector<int64_t>(global.size(), 1)};
          row.offsets.push_back(0);
          row.sizes.push_back(reform.fragment_numel());
          DcpWriteItem item = DcpTensorItem(fqn, DType::kFloat32, reform.saved_shape(), std::move(row),
                                            BytesFrom(state.bytes, ByteOffsetOf(rank_piece, r, DType::kFloat32)));
          item.reformulated_from = global;
          item.from = state.from;
          files->At(t, StageOf(r, target)).push_back(std::move(item));
        }
      }
    }
  }
  return Status::Ok();
}

// What Megatron-Core 0.14's common state keeps of each parameter's state
// beside the reformulated tensors: {index: {'step': tensor(step)}} for the
// parameters of the rank that saves it (TP rank 0 of the first stage).
Result<Value> ModelSpaceParamState(const TpWeights& weights, const Value& param_groups, const Target& target) {
  const Value* step = param_groups.as_list().items.empty() ? nullptr : Find(param_groups.as_list().items[0], "step");
  if (step == nullptr || !step->is(Value::Kind::kFloat)) {
    return Status::Internal("Megatron-Core's param groups record no float step");
  }
  const float value = static_cast<float>(step->as_float());
  auto bytes = std::make_shared<std::vector<uint8_t>>(sizeof(float));
  std::memcpy(bytes->data(), &value, sizeof(float));
  const Value tensor = MakeOwnedTensor(DType::kFloat32, {}, bytes);
  Items params;
  for (const RankTensor& r : weights.ranks[0]) {
    if (StageOf(r, target) != 0) continue;
    params.emplace_back(Value::Int(static_cast<int64_t>(params.size())),
                        Value::MakeDict({{Value::String("step"), tensor}}));
  }
  return Value::MakeDict(std::move(params));
}

// The canonical names of the experts' parameters.
std::set<std::string> ExpertParams(const std::vector<RankTensor>& weights) {
  std::set<std::string> experts;
  for (const RankTensor& r : weights) {
    if (ExpertOf(r) >= 0) experts.insert(r.name);
  }
  return experts;
}

// The common state's optimizer entry of `layout` for the optimizers
// Megatron-Core builds at the target's EP (formats/megatron_core/common/
// expert_optimizers.h), a ChainedOptimizer's of two by their indices:
// fully_reshardable's holds each one's param groups (`per_optimizer`),
// dp_reshardable's only the layout (its ranks' items hold the groups).
Value OptimizerEntry(const std::string& layout, std::vector<Value> per_optimizer) {
  auto entry = [&layout](Value param_groups) {
    Value out = Value::MakeDict();
    if (layout == kFullyReshardable) {
      Set(out, "optimizer", Value::MakeDict({{Value::String("param_groups"), std::move(param_groups)}}));
    }
    Set(out, "param_state_sharding_type", Value::String(layout));
    return out;
  };
  if (per_optimizer.size() == 1) return entry(std::move(per_optimizer[0]));
  Items chained;
  for (size_t i = 0; i < per_optimizer.size(); ++i) {
    chained.emplace_back(Value::Int(static_cast<int64_t>(i)), entry(std::move(per_optimizer[i])));
  }
  return Value::MakeDict(std::move(chained));
}

// The optimizer state in `target.layout`, and the common state's `optimizer`
// entry as Megatron-Core writes it for that layout (fully_reshardable and
// fully_sharded_model_space keep the param groups there; dp_reshardable in
// each rank's items).
Result<Value> AddOptimizer(const SourceCheckpoint& src, const std::vector<FullTensor>& states,
                           const TpWeights& weights, const Target& target, std::atomic<int64_t>* read,
                           RankFiles* files, std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_RETURN_IF_ERROR(CheckGrouped(groups, states));
  RESHARD_ASSIGN_OR_RETURN(
      Value param_groups,
      MegatronParamGroups(groups, RunLrSchedule(src.info().metadata, src.info().settings), target.version, notes));
  for (const FullTensor& t : states) RESHARD_RETURN_IF_ERROR(StateName(t).status());
  if (target.layout == kFullyShardedModelSpace) {
    RESHARD_RETURN_IF_ERROR(AddModelSpaceItems(src, weights, target, read, files));
    RESHARD_ASSIGN_OR_RETURN(Value param_state, ModelSpaceParamState(weights, param_groups, target));
    Value out = Value::MakeDict();
    Set(out, "optimizer", Value::MakeDict({{Value::String("param_groups"), std::move(param_groups)}}));
    Set(out, "param_state", std::move(param_state));
    Set(out, "param_state_sharding_type", Value::String(target.layout));
    return out;
  }
  std::vector<Value> per_optimizer =
      ParamGroupsPerOptimizer(param_groups, groups, ExpertParams(weights.ranks[0]), target.ep);
  if (target.layout == kDpReshardable) {
    RESHARD_RETURN_IF_ERROR(AddDpReshardableItems(src, weights, per_optimizer, target, read, files));
  } else {
    RESHARD_RETURN_IF_ERROR(AddOptimizerItems(*src.info().rules, states, weights.ranks[0], target, files));
  }
  return OptimizerEntry(target.layout, std::move(per_optimizer));
}

// The common state: what Megatron-LM's load reads before the tensors.
// 0.14's also says how its sharded state dict was made (content_metadata:
// Megatron-LM 0.14 picks the optimizer layout to load by it).
Value CommonState(const SourceCheckpoint& src, const Target& target, const TpWeights& weights,
                  std::optional<Value> optimizer, std::vector<std::string>* notes) {
  Value state = Value::MakeDict();
  if (target.version == kVersion014) {
    Value content = Value::MakeDict();
    if (optimizer) Set(content, "distrib_optim_sharding_type", Value::String(target.layout));
    Set(content, "chained_optim_avoid_prefix", Value::Bool(true));
    Set(content, "singleton_local_shards", Value::Bool(false));
    Set(state, "content_metadata", std::move(content));
  }
  const LrSchedule schedule = RunLrSchedule(src.info().metadata, src.info().settings);
  if (optimizer) {
    Set(state, "optimizer", std::move(*optimizer));
    // Megatron-LM's load reads the scheduler with the optimizer state, and only then.
    std::optional<Value> scheduler =
        SchedulerState(src.info().metadata, src.info().settings, schedule, src.info().iteration, notes);
    if (scheduler) Set(state, "opt_param_scheduler", std::move(*scheduler));
  }
  const Value* args = Find(src.info().metadata, "args");
  if (args != nullptr && DictItems(*args) != nullptr) {
    const std::optional<bool> tied =
        src.info().rules ? std::optional<bool>(TiesEmbedding(*src.info().rules)) : std::nullopt;
    MegatronLayout layout{target.cut.tp, target.pp, target.dp, weights.padded_vocab, tied,
                          KvGroups(src.info().metadata, src.info().settings), target.pipeline.split,
                          target.pipeline.vpp(), {}, {}};
    ReadBiases(weights.ranks[0], &layout);
    Value model_args = *args;
    if (target.experts > 0) {  // Megatron-LM's names; the experts split over TP as the dense layers
      Set(model_args, "num_experts", Value::Int(target.experts));
      Set(model_args, "expert_model_parallel_size", Value::Int(target.ep));
      Set(model_args, "expert_tensor_parallel_size", Value::Int(target.cut.tp));
    }
    Value written = MegatronArgs(model_args, layout, notes);
    // The true vocabulary size, as Megatron-LM's --vocab-size records it: what
    // re-padding for another TP needs.
    const std::optional<int64_t> vocab = target.cut.vocab_size ? target.cut.vocab_size : src.info().vocab_size;
    if (vocab) Set(written, "vocab_size", Value::Int(*vocab));
    // And the divisor it pads to, given by --set where the source's args lack it.
    if (const std::optional<int64_t> divisor = src.info().vocab_divisible_by; divisor && *divisor > 0) {
      Set(written, "make_vocab_size_divisible_by", Value::Int(*divisor));
    }
    // And the learning-rate schedule the optimizer's groups are paired by.
    WriteLrSchedule(schedule, &written);
    Set(state, "args", std::move(written));
  }
  Set(state, "checkpoint_version", Value::Float(3.0));
  Set(state, "iteration", Value::Int(src.info().iteration));
  return state;
}

// The Megatron-Core version that loads `layout`: each loads only its own.
std::string VersionOfLayout(const std::string& layout) {
  return layout == kFullyShardedModelSpace ? kVersion014 : kVersion019;
}

// The version and optimizer layout written: as given; a version by its
// layout, else the source's, else 0.19; a layout by its version (0.14's
// default, or 0.19's: the source's dp_reshardable, else fully_reshardable).
Status ChooseForm(const SourceCheckpoint& src, const ExportOptions& options, Target* target) {
  const std::string& own = src.info().format_version;
  const std::string version = FormatOption(options, kVersionOption), layout = FormatOption(options, kLayoutOption);
  target->version = !version.empty() ? version : !layout.empty() ? VersionOfLayout(layout) : !own.empty() ? own : kVersion019;
  const std::string fallback = target->version == kVersion014          ? kFullyShardedModelSpace
                               : src.info().optimizer_layout == kDpReshardable ? kDpReshardable
                                                                                : kFullyReshardable;
  target->layout = layout.empty() ? fallback : layout;
  if (VersionOfLayout(target->layout) != target->version) {
    return Status::InvalidInput("Megatron-Core " + target->version + " does not load the optimizer layout " +
                                target->layout + " (each version loads only its own); use --optimizer-layout " +
                                fallback + ", or --megatron-core-version " + VersionOfLayout(target->layout) +
                                " for " + target->layout);
  }
  if (const int64_t bucket_size = FormatCount(options, kBucketSizeOption); bucket_size > 0) {
    target->bucket_size = bucket_size;
  }
  return Status::Ok();
}

Status CheckSource(const SourceCheckpoint& src, const ExportOptions& options) {
  const std::shared_ptr<const RuleSet>& rules = src.info().rules;
  if (rules == nullptr || rules->section<TorchDistLayout>() == nullptr) {
    return Status::Unsupported("export --to torch_dist writes the keys a rule set's torch_dist section names, and " +
                               (rules == nullptr ? "this " + src.info().kind + " checkpoint is read without a rule set" +
                                                      src.info().NoRulesWhy()
                                                 : "rule set " + rules->name() + " has none") +
                               "; export --to consolidated writes its tensors");
  }
  if (options.tp < 1 || options.pp < 1 || options.dp < 0) {
    return Status::InvalidInput("export --to torch_dist needs the target layout: --tp N and --pp N (both >= 1), "
                                "and --dp N >= 1 if given");
  }
  if (!FormatOption(options, kLayoutOption).empty() && options.weights_only) {
    return Status::InvalidInput("--weights-only leaves the optimizer state out, which --optimizer-layout lays out; "
                                "give one of them");
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
  RESHARD_RETURN_IF_ERROR(CheckFp32Masters(all, "torch_dist"));
  for (FullTensor& t : all) {
    if (t.section == "optimizer") states.push_back(std::move(t));
  }
  if (states.empty() && !FormatOption(options, kLayoutOption).empty()) {
    return Status::InvalidInput("--optimizer-layout: the source has no optimizer state; drop the option");
  }
  return states;
}

// --ddp-bucket-size cuts dp_reshardable's buckets, and nothing else.
Status CheckBucketSize(const Target& target, const std::vector<FullTensor>& states) {
  if (!target.bucket_size || (!states.empty() && target.layout == kDpReshardable)) return Status::Ok();
  return Status::InvalidInput("--ddp-bucket-size cuts the grad buffers of the optimizer layout dp_reshardable, and " +
                              (states.empty() ? std::string("no optimizer state is written")
                                              : "the layout written is " + target.layout) +
                              "; drop it, or write --optimizer-layout dp_reshardable");
}

int CountBlocks(const std::vector<RankTensor>& tensors) {
  int blocks = 0;
  for (const RankTensor& t : tensors) blocks = std::max(blocks, t.block + 1);
  return blocks;
}

int CountExperts(const std::vector<RankTensor>& tensors) {
  int experts = 0;
  for (const RankTensor& t : tensors) experts = std::max(experts, ExpertOf(t) + 1);
  return experts;
}

// The expert-parallel size: given for a model with experts (and only for
// one), dividing its experts, and a layout Megatron-Core builds: EP x the
// experts' TP (the dense TP) divides a stage's TP x DP ranks.
Status CheckExpertParallel(int ep, Target* target) {
  if (target->experts == 0) {
    if (ep == 0) return Status::Ok();
    return Status::InvalidInput("--ep sets the expert-parallel size of a model with experts, and this one has none; "
                                "leave it out");
  }
  const std::string experts = Count(target->experts, "expert");
  if (ep == 0) {
    return Status::InvalidInput("export --to torch_dist of a model with " + experts + " per layer needs the target's "
                                "expert-parallel size: give --ep N (N dividing " + std::to_string(target->experts) +
                                "; convert keeps the source's where it records it, and this one does not)");
  }
  if (target->experts % ep != 0) {
    return Status::InvalidInput("--ep " + std::to_string(ep) + " does not divide the " + experts +
                                " of each MoE layer; give an --ep that divides " + std::to_string(target->experts));
  }
  if (target->dp % ep != 0) {
    const int tp = target->cut.tp;
    return Status::InvalidInput("Megatron-Core needs EP x expert TP (" + std::to_string(ep) + " x " + std::to_string(tp) +
                                ") to divide the ranks of a pipeline stage (TP x DP = " + std::to_string(tp) + " x " +
                                std::to_string(target->dp) + "), so EP must divide DP; give --dp N with N a multiple "
                                "of " + std::to_string(ep) + ", or an --ep that divides " + std::to_string(target->dp));
  }
  target->ep = ep;
  return Status::Ok();
}

// The optimizer state of a model with experts is written in Megatron-Core
// 0.19's layouts, which know its expert-parallel optimizer.
Status CheckExperts(const Target& target, const std::vector<FullTensor>& states) {
  if (target.experts == 0 || states.empty() || target.layout != kFullyShardedModelSpace) return Status::Ok();
  return Status::Unsupported("export --to torch_dist: the optimizer state of a model with experts is written in "
                             "Megatron-Core 0.19's layouts only, not yet as " + target.layout +
                             "; give --optimizer-layout " + kDpReshardable + " or " + kFullyReshardable +
                             ", or --weights-only");
}

// What a loader of the folder must be told.
std::string LoadNote(const std::vector<FullTensor>& states, const std::string& layout) {
  if (states.empty()) {
    return "torch_dist: weights only, no optimizer or RNG state; load with --no-load-optim --no-load-rng (or "
           "--finetune, which also restarts the iteration count)";
  }
  return "torch_dist: the optimizer state as " + layout + " (Megatron-Core " + VersionOfLayout(layout) + "'s" +
         (layout == kFullyReshardable ? "; load with --dist-ckpt-optim-fully-reshardable" : "") +
         "), no RNG state (load with --no-load-rng)";
}

Result<OutputPlan> PlanTorchDist(const SourceCheckpoint& src, const ExportOptions& options,
                                 std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckSource(src, options));
  const RuleSet& rules = *src.info().rules;
  Target target;
  target.cut = TpCut{options.tp, options.replicated, options.vocab_size,
                     FormatOption(options, "from") == "masters" ? kFp32Master : ""};
  target.pp = options.pp;
  target.dp = std::max(options.dp, 1);
  RESHARD_ASSIGN_OR_RETURN(target.dtype, ExportDType(FormatOption(options, "dtype")));
  RESHARD_RETURN_IF_ERROR(ChooseForm(src, options, &target));
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(TpWeights weights, src.WeightsForTp(target.cut, notes, out.read.get()));
  target.blocks = CountBlocks(weights.ranks[0]);
  target.experts = CountExperts(weights.ranks[0]);
  RESHARD_RETURN_IF_ERROR(CheckExpertParallel(options.ep, &target));
  RESHARD_ASSIGN_OR_RETURN(target.pipeline, ChooseTargetPipeline(src, options, target.blocks, target.pp, notes));

  RankFiles files(target);
  for (int t = 0; t < options.tp; ++t) {
    RESHARD_RETURN_IF_ERROR(AddRankItems(rules, weights.ranks[t], t, target, &files));
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> states, OptimizerStates(src, options, out.read.get()));
  RESHARD_RETURN_IF_ERROR(CheckBucketSize(target, states));
  RESHARD_RETURN_IF_ERROR(CheckExperts(target, states));
  std::optional<Value> optimizer;
  if (!states.empty()) {
    RESHARD_ASSIGN_OR_RETURN(optimizer, AddOptimizer(src, states, weights, target, out.read.get(), &files, notes));
  }
  AddExtraStates(rules, target, &files);
  const std::string folder = IterationFolder(src.info().iteration);
  Value common = CommonState(src, target, weights, std::move(optimizer), notes);
  const bool v014 = target.version == kVersion014;
  if (v014) {
    RESHARD_ASSIGN_OR_RETURN(PlannedFile common_file,
                             TorchFile(folder + "/" + kCommonFile, "common state", std::move(common)));
    SetUnsaidFrom(&common_file, "", "the source's optimizer step");  // each parameter's
    out.files.push_back(std::move(common_file));
  } else {
    files.At(0, 0).push_back(DcpBytesItem(kCommonState, Value::MakeList({std::move(common)})));
  }

  for (int rank = 0; rank < static_cast<int>(files.all().size()); ++rank) {
    if (files.all()[rank].empty()) continue;  // a DP rank of a layout that gives it nothing to write
    const int t = rank % options.tp, d = rank / options.tp % target.dp, p = rank / (options.tp * target.dp);
    RESHARD_ASSIGN_OR_RETURN(DcpFileLayout file,
                             LayOutDcpFile("__" + std::to_string(rank) + "_0.distcp", std::move(files.all()[rank])));
    out.files.push_back(DcpDataFile(folder, "stage " + std::to_string(p) + ", TP rank " + std::to_string(t) +
                                                (target.dp > 1 ? ", DP rank " + std::to_string(d) : ""),
                                    std::move(file), kPartBytes));
  }
  std::vector<const PlannedFile*> data;
  for (const PlannedFile& f : out.files) {
    if (f.container == PlannedFile::Container::kDcp) data.push_back(&f);
  }
  RESHARD_ASSIGN_OR_RETURN(PlannedFile metadata, DcpMetadataFile(folder, data, {v014}));
  out.files.push_back(std::move(metadata));
  out.files.push_back(TextFile(folder + "/metadata.json", v014 ? kMetadataJson014 : kMetadataJson));
  out.files.push_back(TextFile(kLatestIterationFile, std::to_string(src.info().iteration)));
  out.summary = "torch_dist (Megatron-Core " + target.version + "): TP " + std::to_string(options.tp) + ", PP " + std::to_string(target.pp) +
                (target.dp > 1 ? ", DP " + std::to_string(target.dp) : "") + ", iteration " + std::to_string(src.info().iteration) + "; " +
                Count(target.blocks, "block") + ", stacked" +
                (target.experts > 0 ? "; " + Count(target.experts, "expert") + " per layer, EP " + std::to_string(target.ep) : "") +
                (target.pipeline.split.Even() ? "" : " (" + target.pipeline.stages.Describe() + ")") + "; padded vocabulary " +
                std::to_string(weights.padded_vocab) +
                (states.empty() ? "; weights only" : "; optimizer state " + target.layout) +
                (target.bucket_size ? ", first stage's buckets of " + std::to_string(*target.bucket_size) + " elements" : "") +
                "\n";
  notes->push_back(LoadNote(states, target.layout));
  if (std::string note = PipelineLoadNote("torch_dist", target.pipeline); !note.empty()) notes->push_back(note);
  return out;
}

}  // namespace

TargetFormat TorchDistTarget() {
  using Kind = FormatOptionInfo::Kind;
  TargetFormatInfo info{"torch_dist",
                        "Megatron-Core's distributed checkpoint at --tp / --pp (--dp: the optimizer's; --ep: the experts')",
                        "the root holding iter_N/ and latest_checkpointed_iteration.txt"};
  info.tp = info.pp = info.dp = info.ep = true;
  info.options = {
      {kLayoutOption, Kind::kText,
       "The optimizer state's layout, Megatron-Core 0.19's fully_reshardable or dp_reshardable (its training "
       "default), or 0.14's fully_sharded_model_space (its default); default: the version's (0.19: a torch_dist "
       "source's own, else fully_reshardable); the state is written unless --weights-only",
       {kFullyReshardable, kDpReshardable, kFullyShardedModelSpace}},
      {kVersionOption, Kind::kText,
       "The Megatron-Core version whose form is written, 0.14 (common.pt) or 0.19 (the common_state item); "
       "default: the --optimizer-layout's, else a torch_dist source's own, else 0.19",
       {kVersion014, kVersion019}},
      {kBucketSizeOption, Kind::kCount,
       "dp_reshardable: Megatron-LM's --ddp-bucket-size (elements), the buckets of the first stage's grad buffers as "
       "--overlap-grad-reduce cuts them (default: one bucket per buffer)"},
      FromOption("weights"),
      DTypeOption()};
  for (FormatOptionInfo& o : PipelineSplitOptions()) info.options.push_back(std::move(o));
  return {std::move(info), PlanTorchDist};
}

}  // namespace reshard
