#include "formats/megatron_core/torch_dist/torch_dist_optimizer.h"

#include <algorithm>
#include <set>

#include "formats/megatron_core/common/expert_optimizers.h"
#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/megatron_core/common/megatron_gathered.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/nd_reformulation.h"
#include "formats/megatron_core/common/optimizer_layouts.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kWeightsOnlyFix[] = "; pass --weights-only to convert the weights without it";

// The list Megatron wraps a bytes item's object in, unwrapped.
const Value& Unwrapped(const Value& v) {
  return v.is(Value::Kind::kList) && v.as_list().items.size() == 1 ? v.as_list().items[0] : v;
}

bool HasPrefix(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// `fqn` without the `chained_{n}.` Megatron-Core puts before the keys of
// each of its chained optimizers.
std::string Unchained(const std::string& fqn) {
  if (!HasPrefix(fqn, "chained_")) return fqn;
  const size_t dot = fqn.find('.');
  return dot == std::string::npos ? fqn : fqn.substr(dot + 1);
}

// The common state's optimizer entry, the first of a ChainedOptimizer's
// (`{0: {...}, 1: {...}}`, which name one layout), or null.
const Value* FirstOptimizerEntry(const Value& common) {
  const Value* optimizer = Find(common, "optimizer");
  const Items* items = optimizer != nullptr ? DictItems(*optimizer) : nullptr;
  if (items != nullptr && !items->empty() && items->front().first.is(Value::Kind::kInt)) return &items->front().second;
  return optimizer;
}

// The layout the common state names; without one, the one the keys show.
std::string LayoutOf(const DcpContent& c, const Value& common) {
  const Value* optimizer = FirstOptimizerEntry(common);
  const Value* type = optimizer != nullptr ? Find(*optimizer, "param_state_sharding_type") : nullptr;
  if (type != nullptr && type->is(Value::Kind::kString)) return type->as_string();
  for (const DcpTensor& t : c.tensors) {
    if (HasPrefix(Unchained(t.fqn), "optimizer.distributed.")) return kDpReshardable;
    if (HasPrefix(t.fqn, "optimizer.state.param.")) return kFullyReshardable;
    if (HasPrefix(t.fqn, "optimizer.state.fp32_param.")) return kFullyShardedModelSpace;
  }
  for (const std::string& fqn : c.bytes_items) {
    if (HasPrefix(fqn, "optimizer.distributed.") && fqn.find(".param_state/") != std::string::npos) {
      return kDpZeroGatherScatter;  // the whole state pickled per rank
    }
  }
  return "an unnamed layout";
}

// Param groups without `params`, and the step they record.
Status ReadGroups(const Value* groups, const std::string& where, TorchDistOptimizer* out) {
  if (groups == nullptr || !groups->is(Value::Kind::kList) || groups->as_list().items.empty()) {
    return Status::InvalidInput(where + " holds no param_groups; the checkpoint's optimizer state is incomplete" +
                                kWeightsOnlyFix);
  }
  for (const Value& group : groups->as_list().items) {
    if (DictItems(group) == nullptr) return Status::InvalidInput(where + "'s param_groups are not dicts" + kWeightsOnlyFix);
    Value g = group;
    Items& items = *MutableDictItems(g);
    items.erase(std::remove_if(items.begin(), items.end(),
                               [](const auto& kv) { return kv.first.is(Value::Kind::kString) && kv.first.as_string() == "params"; }),
                items.end());
    out->param_groups.push_back(std::move(g));
  }
  if (const Value* step = Find(out->param_groups[0], "step")) out->step = *step;
  return Status::Ok();
}

// A chained optimizer's param groups: where they are kept, and its
// `{'param_groups': ...}` there (null where it has none).
struct ChainedGroups {
  std::string where;
  const Value* optimizer = nullptr;
};

// The groups of a ChainedOptimizer's optimizers (a model with experts at
// EP > 1 keeps the dense parameters' and the experts'), as one optimizer's
// (the writer splits them again for its target's EP).
Status ReadChainedGroups(const std::vector<ChainedGroups>& chained, TorchDistOptimizer* out) {
  TorchDistOptimizer all;
  for (const ChainedGroups& entry : chained) {
    RESHARD_RETURN_IF_ERROR(ReadGroups(entry.optimizer != nullptr ? Find(*entry.optimizer, "param_groups") : nullptr,
                                       entry.where, &all));
  }
  Result<std::vector<Value>> groups = ParamGroupsAsOneOptimizer(all.param_groups);
  if (!groups.ok()) return Status::Unsupported(groups.status().message() + kWeightsOnlyFix);
  out->param_groups = std::move(*groups);
  out->step = all.step;
  return Status::Ok();
}

// The param groups of the common state's optimizer (`{'optimizer':
// {'optimizer': {'param_groups': ...}}}`, a ChainedOptimizer's by index),
// where the layouts that gather the state per model key keep them.
Status ReadCommonGroups(const Value& common, TorchDistOptimizer* out) {
  const Value* optimizer = Find(common, "optimizer");
  const Value* inner = optimizer != nullptr ? Find(*optimizer, "optimizer") : nullptr;
  const Items* chained = optimizer != nullptr && inner == nullptr ? DictItems(*optimizer) : nullptr;
  if (chained != nullptr && !chained->empty() && chained->front().first.is(Value::Kind::kInt)) {
    std::vector<ChainedGroups> entries;
    for (const auto& [index, entry] : *chained) {
      entries.push_back({"the common state's optimizer " + index.DebugString(20), Find(entry, "optimizer")});
    }
    return ReadChainedGroups(entries, out);
  }
  return ReadGroups(inner != nullptr ? Find(*inner, "param_groups") : nullptr, "the common state", out);
}

// The `numel` elements of `flat` from `offset` as a chunk at `box` (of
// that many elements) of a state tensor: a piece of a flat buffer placed.
SourceShard FlatPiece(const SourceShard& flat, int64_t offset, const Box& box) {
  SourceShard chunk;
  chunk.shape = box.sizes;
  chunk.placements = {Placement{box, std::vector<int64_t>(box.sizes.size(), 0)}};
  chunk.runs = flat.RunsOf(offset, box.numel(), ElementSize(DType::kFloat32));
  return chunk;
}

std::vector<std::string> ModelKeys(const DcpContent& c) {
  std::vector<std::string> keys;
  for (const DcpTensor& t : c.tensors) {
    if (!IsOptimizerKey(t.fqn)) keys.push_back(t.fqn);
  }
  return keys;
}

// fully_reshardable: every state of every model key is a tensor of its own,
// shaped and chunked like the key.
Status ReadFullyReshardable(const DcpContent& c, const Value& common, TorchDistOptimizer* out) {
  for (const std::string& key : ModelKeys(c)) {
    const DcpTensor& model = *c.FindTensor(key);
    for (const char* state : kTorchDistStates) {
      const std::string fqn = std::string("optimizer.state.") + state + "." + key;
      const DcpTensor* t = c.FindTensor(fqn);
      if (t == nullptr || t->size != model.size || t->dtype != DType::kFloat32) {
        return Status::InvalidInput(c.folder + (t == nullptr ? " has no " + fqn : "'s " + fqn + " is not fp32 " +
                                    ShapeString(model.size)) + " (the fully_reshardable state of " + key + ")" +
                                    kWeightsOnlyFix);
      }
      out->states[state][key] = *t;
    }
  }
  return ReadCommonGroups(common, out);
}

// ---- fully_sharded_model_space --------------------------------------------

// `state` of `model` saved reformulated (nd_reformulation.h): each fragment,
// a run of the saved tensor's elements, a chunk at its box of the key.
Result<DcpTensor> ReformulatedState(const DcpContent& c, const DcpTensor& model, const std::string& state) {
  // Megatron-Core 0.14 names the fp32 master `fp32_param`.
  const std::string fqn =
      "optimizer.state." + (state == kTorchDistStates[0] ? std::string("fp32_param") : state) + "." + model.fqn;
  const DcpTensor* saved = c.FindTensor(fqn);
  const auto orig = c.meta.nd_reformulated_orig_shapes.find(fqn);
  std::string problem;
  if (saved == nullptr) {
    problem = " has no " + fqn;
  } else if (saved->dtype != DType::kFloat32) {
    problem = "'s " + fqn + " is not fp32";
  } else if (orig == c.meta.nd_reformulated_orig_shapes.end()) {
    problem = "'s .metadata records no original shape (mcore_data nd_reformulated_orig_global_shape) of " + fqn;
  } else if (orig->second != model.size) {
    problem = "'s " + fqn + " reformulates a tensor of shape " + ShapeString(orig->second) + ", not " +
              ShapeString(model.size);
  }
  if (!problem.empty()) {
    return Status::InvalidInput(c.folder + problem + " (the fully_sharded_model_space state of " + model.fqn + ")" +
                                kWeightsOnlyFix);
  }
  Result<NdReformulation> r = ReadNdReformulation(saved->size, orig->second, fqn);
  if (!r.ok()) return Status::InvalidInput(c.folder + ": " + r.status().message() + kWeightsOnlyFix);
  const SourceShard flat = SliceRuns(*saved, -1);
  DcpTensor out{"optimizer " + state + " of " + model.fqn, DType::kFloat32, model.size, {}};
  for (int64_t j = 0; j < r->fragments(); ++j) {
    out.shards.push_back(FlatPiece(flat, j * r->fragment_numel(), r->FragmentBox(j)));
  }
  return out;
}

Status ReadFullyShardedModelSpace(const DcpContent& c, const Value& common, TorchDistOptimizer* out) {
  for (const std::string& key : ModelKeys(c)) {
    for (const char* state : kTorchDistStates) {
      RESHARD_ASSIGN_OR_RETURN(out->states[state][key], ReformulatedState(c, *c.FindTensor(key), state));
    }
  }
  return ReadCommonGroups(common, out);
}

// ---- dp_reshardable ------------------------------------------------------

// One parameter of a model-parallel rank: a model key (of one layer when
// stacked) and the boxes of it the rank holds, in the order its flat
// piece holds them.
struct RankParam {
  const DcpTensor* key = nullptr;
  int64_t layer = -1;
  int64_t expert = -1;     // of an expert's key: which expert (the axis after the layer axis)
  std::vector<Box> boxes;  // of the key's global tensor, the layer (and expert) axis included
  int64_t numel = 0;
  // A TP rank but the first's copy of a tensor every rank holds whole, or
  // the last stage's copy of a tied embedding: left out, as
  // fully_reshardable leaves it out (Megatron keeps replicas equal).
  bool replica = false;
  bool shared_embedding = false;  // a tied embedding's copy at PP > 1: a bucket of its own
  int chunk = 0;                  // the model chunk (virtual pipeline stage) registering it
};

// TP rank `rank`'s boxes of `reg`'s tensor `t` (its layer, and expert,
// when >= 0): the chunks' ranges on the one axis they cut, rank r holding
// ranges r, TP + r, ... (a tensor of k parts each cut by TP, as SwiGLU's
// [gate; up]).
Result<RankParam> PieceOf(const DcpTensor& t, const RegisteredParam& reg, int tp, int rank) {
  // The leading axes fixed: the layer's, then the expert's.
  std::vector<int64_t> fixed;
  if (reg.layer >= 0) fixed.push_back(reg.layer);
  if (reg.expert >= 0) fixed.push_back(reg.expert);
  const size_t first = fixed.size();
  if (t.size.size() <= first) {
    return Status::InvalidInput(t.fqn + " has no axis for its layer or expert, so its dp_reshardable state cannot "
                                "be placed" + std::string(kWeightsOnlyFix));
  }
  std::vector<std::set<std::pair<int64_t, int64_t>>> ranges(t.size.size());
  Box whole = Box::Whole(t.size);
  for (size_t d = 0; d < first; ++d) {
    whole.offsets[d] = fixed[d];
    whole.sizes[d] = 1;
  }
  for (const SourceShard& chunk : t.shards) {
    const Box& box = chunk.placements[0].global;
    bool holds = true;
    for (size_t d = 0; d < first; ++d) holds &= fixed[d] >= box.offsets[d] && fixed[d] < box.end(d);
    if (!holds) continue;
    for (size_t d = first; d < ranges.size(); ++d) ranges[d].insert({box.offsets[d], box.sizes[d]});
  }
  RankParam p{&t, reg.layer, reg.expert, {}, 0};
  int axis = -1;
  for (size_t d = first; d < ranges.size(); ++d) {
    if (ranges[d].size() <= 1) continue;
    if (axis >= 0 || ranges[d].size() % tp != 0) {
      return Status::Unsupported(t.fqn + "'s chunks are no cut of TP " + std::to_string(tp) +
                                 ", so its dp_reshardable state cannot be placed" + kWeightsOnlyFix);
    }
    axis = static_cast<int>(d);
  }
  if (axis < 0) {
    p.boxes.push_back(whole);
    p.replica = rank > 0;
  } else {
    const std::vector<std::pair<int64_t, int64_t>> sorted(ranges[axis].begin(), ranges[axis].end());
    // Pieces one after the other in the flat slice are boxes one after the
    // other only when they are cut on the first axis of the tensor.
    if (sorted.size() > static_cast<size_t>(tp) && static_cast<size_t>(axis) != first) {
      return Status::Unsupported(t.fqn + " is cut in " + std::to_string(sorted.size()) + " pieces on axis " +
                                 std::to_string(axis) + ", a layout Megatron-Core's rank pieces do not have" +
                                 kWeightsOnlyFix);
    }
    for (size_t j = rank; j < sorted.size(); j += tp) {
      Box box = whole;
      box.offsets[axis] = sorted[j].first;
      box.sizes[axis] = sorted[j].second;
      p.boxes.push_back(box);
    }
  }
  for (const Box& box : p.boxes) p.numel += box.numel();
  return p;
}

// One grad buffer as per_bucket_numel records it.
struct BufferNumels {
  DType param_dtype = DType::kFloat32, grad_dtype = DType::kFloat32;
  std::vector<int64_t> numels;
};

// `[{(param dtype, grad dtype): [numel per bucket]} per grad buffer]`.
Result<std::vector<BufferNumels>> ReadNumels(const DcpContent& c, const MegatronDpGroup& group,
                                             const std::string& which) {
  const std::string key = group.ItemKey(which);
  RESHARD_ASSIGN_OR_RETURN(Value v, c.ReadBytes(key));
  const Value& buffers = Unwrapped(v);
  const Status bad = Status::InvalidInput(key + " is not Megatron-Core's [{(param dtype, grad dtype): [numels]}]" +
                                          kWeightsOnlyFix);
  if (!buffers.is(Value::Kind::kList)) return bad;
  std::vector<BufferNumels> out;
  for (const Value& buffer : buffers.as_list().items) {
    const Items* items = DictItems(buffer);
    if (items == nullptr || items->size() != 1 || !items->front().first.is(Value::Kind::kTuple)) return bad;
    const std::vector<Value>& dtypes = items->front().first.as_tuple().items;
    std::vector<int64_t> numels;
    if (dtypes.size() != 2 || !DTypeOfTorchGlobal(dtypes[0]) || !DTypeOfTorchGlobal(dtypes[1]) ||
        !ReadIntSequence(items->front().second, &numels)) {
      return bad;
    }
    out.push_back({*DTypeOfTorchGlobal(dtypes[0]), *DTypeOfTorchGlobal(dtypes[1]), std::move(numels)});
  }
  return out;
}

// The layouts of flat buffers per model-parallel rank: dp_reshardable (a
// tensor per bucket) and, `gathered`, dp_zero_gather_scatter (the buckets
// gathered, one object per rank). Both are placed by the same registration
// order and bucket layout.
class FlatBufferReader {
 public:
  FlatBufferReader(const DcpContent& c, const TorchDistLayout& layout, const ArgsLookup& args, bool gathered,
                   TorchDistOptimizer* out)
      : c_(c), layout_(layout), args_(args), gathered_(gathered), out_(*out) {}

  Status Read() {
    if (layout_.optimizer_order.empty()) {
      return Status::Unsupported("the rule set's torch_dist section gives no optimizer_order, the registration "
                                 "order the optimizer's flat buffers follow; add one (docs/rules.md)" +
                                 std::string(kWeightsOnlyFix));
    }
    RESHARD_RETURN_IF_ERROR(ReadGrid());
    // At EP > 1 the dense optimizer holds no expert; else it holds them all.
    const OptimizerShare dense{true, 0, chained_ ? 0 : experts_};
    for (int pp_rank = 0; pp_rank < pp_; ++pp_rank) {
      for (int tp_rank = 0; tp_rank < tp_; ++tp_rank) {
        const MegatronDpGroup group{MegatronDpGroupIdx(tp_rank, pp_rank, tp_), chained_ ? 0 : -1};
        RESHARD_RETURN_IF_ERROR(ReadRank(group, tp_rank, pp_rank, dense, dp_));
      }
    }
    if (chained_) RESHARD_RETURN_IF_ERROR(ReadExperts());
    RESHARD_RETURN_IF_ERROR(CheckComplete());
    return ReadParamGroups();
  }

 private:
  // Megatron-Core's ChainedOptimizer at EP > 1: the experts' optimizer, its
  // items `chained_1.`, one model-parallel rank per (expert TP rank = TP
  // rank, EP rank, PP rank), each holding its EP rank's experts, its
  // buffers sharded over the expert-data-parallel group (DP / EP).
  Status ReadExperts() {
    if (const std::optional<int64_t> etp = args_("args.expert_tensor_parallel_size"); etp && *etp != tp_) {
      return Status::Unsupported(c_.folder + "'s args record expert_tensor_parallel_size " + std::to_string(*etp) +
                                 " at TP " + std::to_string(tp_) + ", and reshard reads the experts' dp_reshardable "
                                 "state split over TP as the dense layers; read it from the run's fully_reshardable "
                                 "save (Megatron-LM's --dist-ckpt-optim-fully-reshardable)" + kWeightsOnlyFix);
    }
    int groups = 0;
    while (c_.meta.Find(MegatronDpGroup{groups, 1}.ItemKey("per_bucket_numel"), {}) != nullptr) ++groups;
    const int ep = groups / (tp_ * pp_);
    if (experts_ == 0 || ep < 1 || ep * tp_ * pp_ != groups || experts_ % ep != 0) {
      return Status::Unsupported(c_.folder + " holds " + Count(groups, "model-parallel group") + " of the experts' "
                                 "optimizer, which are no EP dividing its " + Count(experts_, "expert") + " at TP " +
                                 std::to_string(tp_) + " and PP " + std::to_string(pp_) + " (reshard reads the experts "
                                 "split over TP as the dense layers)" + kWeightsOnlyFix);
    }
    const int64_t local = experts_ / ep;
    // The expert-data-parallel size, with the experts' TP the dense one.
    const int expert_dp = dp_ % ep == 0 ? dp_ / ep : 1;
    for (int pp_rank = 0; pp_rank < pp_; ++pp_rank) {
      for (int ep_rank = 0; ep_rank < ep; ++ep_rank) {
        for (int tp_rank = 0; tp_rank < tp_; ++tp_rank) {
          const MegatronDpGroup group{MegatronExpertDpGroupIdx(tp_rank, ep_rank, pp_rank, tp_, ep), 1};
          RESHARD_RETURN_IF_ERROR(
              ReadRank(group, tp_rank, pp_rank, OptimizerShare{false, ep_rank * local, local}, expert_dp));
        }
      }
    }
    return Status::Ok();
  }

  // The param groups of model-parallel rank 0's `optimizer` item; of each
  // chained optimizer's, as one optimizer's.
  Status ReadParamGroups() {
    if (!chained_) {
      const std::string key = MegatronDpGroup{}.ItemKey("optimizer");
      RESHARD_ASSIGN_OR_RETURN(Value groups, c_.ReadBytes(key));
      return ReadGroups(Find(Unwrapped(groups), "param_groups"), key, &out_);
    }
    std::vector<Value> items(2);  // what `entries` point into
    std::vector<ChainedGroups> entries;
    for (int chained = 0; chained < 2; ++chained) {
      const std::string key = MegatronDpGroup{0, chained}.ItemKey("optimizer");
      RESHARD_ASSIGN_OR_RETURN(items[chained], c_.ReadBytes(key));
      entries.push_back({key, &Unwrapped(items[chained])});
    }
    return ReadChainedGroups(entries, &out_);
  }

  // TP, PP, DP and the layers of each stage: TP and DP the args' where they
  // record them, else TP from the first key's cut (the vocabulary-parallel
  // embedding), and DP 1; PP from the number of model-parallel ranks; the
  // stages' layers as Megatron-Core splits them by the args' (or --set's)
  // stage sizes, evenly where they record none; DP 1 (any DP that divides
  // 128 lays the buffers out the same; the numels check it; the gathered
  // form is the same at any DP).
  Status ReadGrid() {
    const char* item = gathered_ ? "param_state" : "per_bucket_numel";
    chained_ = !gathered_ && c_.meta.Find(MegatronDpGroup{0, 0}.ItemKey(item), {}) != nullptr;
    int groups = 0;
    while (c_.meta.Find(MegatronDpGroup{groups, chained_ ? 0 : -1}.ItemKey(item), {}) != nullptr) ++groups;
    if (groups == 0) {
      return Status::Unsupported(c_.folder + " holds the distributed optimizer's buffers without " + item +
                                 " items of one optimizer, nor of a ChainedOptimizer's first (chained_0.)" +
                                 std::string(kWeightsOnlyFix));
    }
    const DcpTensor* first = nullptr;
    for (const std::string& key : layout_.optimizer_order) {
      if ((first = c_.FindTensor(key)) != nullptr) break;
    }
    if (first == nullptr) return Status::InvalidInput(c_.folder + " holds none of the keys of optimizer_order");
    tp_ = static_cast<int>(args_("args.tensor_model_parallel_size").value_or(first->shards.size()));
    dp_ = static_cast<int>(args_("args.data_parallel_size").value_or(1));
    pp_ = tp_ > 0 ? groups / tp_ : 0;
    int layers = 0;
    for (const std::string& key : layout_.optimizer_order) {
      const DcpTensor* t = c_.FindTensor(key);
      if (t != nullptr && layout_.IsStackedKey(key)) layers = static_cast<int>(t->size[0]);
      if (t != nullptr && layout_.IsExpertKey(key) && t->size.size() > 1) experts_ = t->size[1];
    }
    if (pp_ < 1 || pp_ * tp_ != groups) {
      return Status::Unsupported(c_.folder + " has " + Count(groups, "model-parallel optimizer group") +
                                 ", which TP " + std::to_string(tp_) + " (from its chunks) does not divide into "
                                 "pipeline stages" + kWeightsOnlyFix);
    }
    // Each stage's layers and model chunks, as the run split them (its
    // args, or --set): each chunk's buffers follow the previous chunk's.
    const PipelineSplit split = SplitOfArgs([this](const std::string& field) { return args_("args." + field); });
    const int vpp = static_cast<int>(std::max<int64_t>(args_(std::string("args.") + kVppArg).value_or(1), 1));
    Result<PipelineStages> stages = ChunkedStages(layers, pp_, vpp, split, kSetSplitFlags);
    if (!stages.ok()) {
      return Status::Unsupported(c_.folder + "'s optimizer state is laid out for " + Count(pp_, "pipeline stage") +
                                 (vpp > 1 ? " of " + Count(vpp, "model chunk") : std::string()) + ": " +
                                 stages.status().message() + kWeightsOnlyFix);
    }
    stages_ = std::move(*stages);
    return Status::Ok();
  }

  // The word embedding the last stage's output layer copies at PP > 1:
  // null when the rule set ties none or the checkpoint holds an output
  // layer of its own. GPTModel registers the word embedding first.
  const DcpTensor* TiedEmbedding() const {
    if (pp_ == 1 || layout_.tied_head.empty() || c_.FindTensor(layout_.tied_head) != nullptr) return nullptr;
    for (const std::string& key : layout_.optimizer_order) {
      if (const DcpTensor* t = c_.FindTensor(key)) return t;
    }
    return nullptr;
  }

  // The rank's parameters in registration order that the optimizer of
  // `share` holds, model chunk by model chunk (ChunkRegistrationOrder), those
  // the checkpoint holds, and a tied embedding's last-stage copy.
  Result<std::vector<RankParam>> RankParams(int tp_rank, int pp_rank, const OptimizerShare& share) const {
    const DcpTensor* tied = TiedEmbedding();
    std::vector<RankParam> params;
    for (int c = 0; c < stages_.vpp(); ++c) {
      for (const RegisteredParam& r :
           ChunkRegistrationOrder(layout_, stages_, pp_rank, c, tied != nullptr ? layout_.tied_head : "", share)) {
        const bool tied_head = tied != nullptr && r.key == layout_.tied_head;
        const DcpTensor* t = tied_head ? tied : c_.FindTensor(r.key);
        if (t == nullptr) continue;
        RESHARD_ASSIGN_OR_RETURN(RankParam p, PieceOf(*t, r, tp_, tp_rank));
        p.shared_embedding = t == tied;
        p.replica |= tied_head;
        p.chunk = c;
        params.push_back(std::move(p));
      }
    }
    return params;
  }

  // The buffers of `group`, the rank (TP rank, PP rank) of the optimizer of
  // `share`, sharded over `dp` ranks.
  Status ReadRank(const MegatronDpGroup& group, int tp_rank, int pp_rank, const OptimizerShare& share, int dp) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<RankParam> params, RankParams(tp_rank, pp_rank, share));
    std::vector<GatheredParam> list;
    for (const RankParam& p : params) {
      list.push_back({p.key->fqn, p.key->dtype, p.numel, p.shared_embedding, p.chunk});
    }
    BucketOptions options;
    options.dp = dp;
    RESHARD_ASSIGN_OR_RETURN(std::vector<GradBuffer> buffers, MegatronGradBuffers(list, options));
    const ShardCoords at{tp_rank, pp_rank, 0, 0};
    return gathered_ ? ReadGathered(group, at, params, buffers) : ReadBuckets(group, params, buffers, dp);
  }

  // `what`'s grad buffers as the checkpoint records them (`recorded`
  // of them, the b-th of param dtype `dtypes[b]`) against the parameters'.
  Status CheckBuffers(const std::string& what, const std::vector<GradBuffer>& buffers,
                      const std::vector<DType>& dtypes) const {
    if (buffers.size() != dtypes.size()) {
      return Status::InvalidInput(c_.folder + "'s " + what + " records " + std::to_string(dtypes.size()) +
                                  " grad buffers, and its parameters' dtypes make " + std::to_string(buffers.size()) +
                                  kWeightsOnlyFix);
    }
    for (size_t b = 0; b < buffers.size(); ++b) {
      if (dtypes[b] != buffers[b].param_dtype) {
        return Status::InvalidInput(c_.folder + "'s " + what + " grad buffer " + std::to_string(b) + " holds " +
                                    DTypeName(dtypes[b]) + " parameters, the registration order gives " +
                                    DTypeName(buffers[b].param_dtype) + kWeightsOnlyFix);
      }
    }
    return Status::Ok();
  }

  // dp_reshardable: one tensor per bucket, sized by per_bucket_numel.
  Status ReadBuckets(const MegatronDpGroup& group, const std::vector<RankParam>& params,
                     const std::vector<GradBuffer>& buffers, int dp) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<BufferNumels> numel, ReadNumels(c_, group, "per_bucket_numel"));
    RESHARD_ASSIGN_OR_RETURN(std::vector<BufferNumels> unpadded, ReadNumels(c_, group, "per_bucket_numel_unpadded"));
    const std::string what = group.Prefix();
    std::vector<DType> dtypes;
    for (const BufferNumels& n : numel) dtypes.push_back(n.param_dtype);
    if (unpadded.size() != numel.size()) {
      return Status::InvalidInput(c_.folder + "'s " + what + " records " + std::to_string(numel.size()) +
                                  " grad buffers in per_bucket_numel and " + std::to_string(unpadded.size()) +
                                  " in per_bucket_numel_unpadded" + kWeightsOnlyFix);
    }
    RESHARD_RETURN_IF_ERROR(CheckBuffers(what, buffers, dtypes));
    for (size_t b = 0; b < buffers.size(); ++b) {
      RESHARD_RETURN_IF_ERROR(ReadBuffer(group, static_cast<int>(b), params, buffers[b], numel[b], unpadded[b], dp));
    }
    return Status::Ok();
  }

  Status ReadBuffer(const MegatronDpGroup& group, int gbuf, const std::vector<RankParam>& params,
                    const GradBuffer& buffer, const BufferNumels& numel, const BufferNumels& unpadded, int dp) {
    const std::string what = c_.folder + "'s " + group.Prefix() + ".gbuf_idx_" + std::to_string(gbuf);
    // The buffer's buckets as recorded: a run with --overlap-grad-reduce
    // cuts it into buckets of a size no checkpoint records.
    std::vector<BucketParam> list;
    for (size_t i : buffer.params) {
      const RankParam& p = params[i];
      list.push_back({p.key->fqn, p.numel, p.shared_embedding});
    }
    BucketOptions options;
    options.dp = dp;
    Result<BucketLayout> recorded = MegatronRecordedLayout(list, options, numel.numels, unpadded.numels, what);
    if (!recorded.ok()) {
      return Status::InvalidInput(recorded.status().message() + "; the rule set's optimizer_order or the pipeline "
                                  "stage sizes (" + std::string(kSetSplitFlags.first) + ", " + kSetSplitFlags.last +
                                  ") do not describe this run" + kWeightsOnlyFix);
    }
    const BucketLayout& bl = *recorded;
    for (int k = 0; k < static_cast<int>(bl.buckets.size()); ++k) {
      for (const char* state : kTorchDistStates) {
        const std::string key = MegatronBucketKey(group, gbuf, numel.param_dtype, numel.grad_dtype, k, state);
        const DcpTensor* flat = c_.FindTensor(key);
        if (flat == nullptr || flat->size != std::vector<int64_t>{bl.buckets[k].numel_unpadded}) {
          return Status::InvalidInput(c_.folder + (flat == nullptr ? " has no " : "'s " + key + " is not 1-D of the "
                                      "recorded numel: ") + key + kWeightsOnlyFix);
        }
        flats_read_++;
        const SourceShard runs = SliceRuns(*flat, -1);
        for (size_t j = 0; j < buffer.params.size(); ++j) {
          if (bl.slots[j].bucket == k) Place(params[buffer.params[j]], runs, bl.slots[j].offset, state);
        }
      }
    }
    return Status::Ok();
  }

  // dp_zero_gather_scatter: the rank's state gathered onto DP rank 0 and
  // pickled whole (formats/megatron_core/common/megatron_gathered.h), each state of a buffer one
  // flat tensor of the buckets' unpadded ranges.
  Status ReadGathered(const MegatronDpGroup& group, const ShardCoords& at, const std::vector<RankParam>& params,
                      const std::vector<GradBuffer>& buffers) {
    const std::string key = group.ItemKey("param_state");
    RESHARD_ASSIGN_OR_RETURN(Value state, c_.ReadBytes(key));
    RESHARD_ASSIGN_OR_RETURN(std::vector<GatheredBuffer> read,
                             ReadGatheredState(Unwrapped(state), c_.folder + "'s " + key, kWeightsOnlyFix));
    std::vector<DType> dtypes;
    for (const GatheredBuffer& g : read) dtypes.push_back(g.param_dtype);
    RESHARD_RETURN_IF_ERROR(CheckBuffers(key, buffers, dtypes));
    for (size_t b = 0; b < buffers.size(); ++b) {
      if (read[b].numel_unpadded != buffers[b].numel_unpadded) {
        return Status::InvalidInput(c_.folder + "'s " + key + " grad buffer " + std::to_string(b) + " holds " +
                                    std::to_string(read[b].numel_unpadded) + " elements, and its parameters in the "
                                    "rule set's optimizer_order lay out " + std::to_string(buffers[b].numel_unpadded) +
                                    " (one bucket per buffer, none with --overlap-grad-reduce); the rule set or the "
                                    "layout (--set tensor_model_parallel_size) does not describe this run" +
                                    kWeightsOnlyFix);
      }
      for (size_t s = 0; s < read[b].states.size(); ++s) {
        const SourceShard runs = SourceShard::Of(*read[b].states[s], at);
        for (size_t j = 0; j < buffers[b].params.size(); ++j) {
          Place(params[buffers[b].params[j]], runs, buffers[b].offsets[j], kTorchDistStates[s]);
        }
      }
    }
    return Status::Ok();
  }

  // The parameter's flat piece, from `offset` of the bucket, as chunks at
  // its boxes of the state tensor shaped like its key.
  void Place(const RankParam& p, const SourceShard& bucket, int64_t offset, const std::string& state) {
    if (p.replica) return;
    DcpTensor& t = out_.states[state][p.key->fqn];
    if (t.fqn.empty()) t = DcpTensor{"optimizer " + state + " of " + p.key->fqn, DType::kFloat32, p.key->size, {}};
    for (const Box& box : p.boxes) {
      t.shards.push_back(FlatPiece(bucket, offset, box));
      offset += box.numel();
    }
  }

  // Every model key's state is whole, and every flat tensor was read.
  Status CheckComplete() const {
    for (const std::string& key : ModelKeys(c_)) {
      for (const char* state : kTorchDistStates) {
        auto it = out_.states[state].find(key);
        int64_t numel = 0;
        if (it != out_.states[state].end()) {
          for (const SourceShard& chunk : it->second.shards) numel += chunk.placements[0].global.numel();
        }
        if (numel != ShapeNumel(c_.FindTensor(key)->size)) {
          return Status::InvalidInput(key + " is not in the rule set's optimizer_order, or no dp_reshardable buffer "
                                      "holds all of it; add it to torch_dist.optimizer_order" +
                                      std::string(kWeightsOnlyFix));
        }
      }
    }
    int flats = 0;
    for (const DcpTensor& t : c_.tensors) flats += HasPrefix(Unchained(t.fqn), "optimizer.distributed.");
    if (flats != flats_read_) {
      return Status::Unsupported(c_.folder + " holds " + std::to_string(flats) + " dp_reshardable buffers and " +
                                 std::to_string(flats_read_) + " were explained by its model" + kWeightsOnlyFix);
    }
    return Status::Ok();
  }

  const DcpContent& c_;
  const TorchDistLayout& layout_;
  const ArgsLookup& args_;
  const bool gathered_;
  TorchDistOptimizer& out_;
  int tp_ = 1, pp_ = 1, dp_ = 1;
  bool chained_ = false;  // a ChainedOptimizer's items: the dense optimizer's, then the experts'
  int64_t experts_ = 0;   // of each MoE layer; 0: none
  PipelineStages stages_;  // each stage's layers and model chunks
  int flats_read_ = 0;
};

}  // namespace

bool IsOptimizerKey(const std::string& fqn) { return HasPrefix(Unchained(fqn), "optimizer."); }

Result<std::optional<TorchDistOptimizer>> ReadTorchDistOptimizer(const DcpContent& content, const Value& common,
                                                                 const TorchDistLayout& layout,
                                                                 const ArgsLookup& args) {
  const bool any = std::any_of(content.tensors.begin(), content.tensors.end(),
                               [](const DcpTensor& t) { return IsOptimizerKey(t.fqn); }) ||
                   std::any_of(content.bytes_items.begin(), content.bytes_items.end(),
                               IsOptimizerKey);
  if (!any) return std::optional<TorchDistOptimizer>();
  TorchDistOptimizer out;
  out.layout = LayoutOf(content, common);
  if (out.layout == kFullyReshardable) {
    RESHARD_RETURN_IF_ERROR(ReadFullyReshardable(content, common, &out));
  } else if (out.layout == kDpReshardable) {
    RESHARD_RETURN_IF_ERROR(FlatBufferReader(content, layout, args, false, &out).Read());
  } else if (out.layout == kDpZeroGatherScatter) {
    RESHARD_RETURN_IF_ERROR(FlatBufferReader(content, layout, args, true, &out).Read());
  } else if (out.layout == kFullyShardedModelSpace) {
    RESHARD_RETURN_IF_ERROR(ReadFullyShardedModelSpace(content, common, &out));
  } else {
    return Status::Unsupported("the distributed optimizer's state is in Megatron-Core's " + out.layout +
                               " layout, which reshard does not read (it reads Megatron-Core 0.19's "
                               "fully_reshardable and dp_reshardable, and 0.14's fully_sharded_model_space and "
                               "dp_zero_gather_scatter)" +
                               std::string(kWeightsOnlyFix));
  }
  return std::optional<TorchDistOptimizer>(std::move(out));
}

}  // namespace reshard
