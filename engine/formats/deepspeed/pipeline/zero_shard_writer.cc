#include "formats/deepspeed/pipeline/zero_shard_writer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include "plan/materialize.h"
#include "formats/deepspeed/files/torch_state.h"

namespace reshard {
namespace {

// The optimizer state of one target (pipeline, tensor) rank, produced on
// demand: its flat groups, and for every slot where each state's elements
// come from. Shard tensors produce their ranges from it while they are
// written, so nothing is held but this map.
class TargetStage {
 public:
  static Result<std::shared_ptr<const TargetStage>> Make(const SourceOptimizer& opt,
                                                         const OptimizerStagePlan& plan,
                                                         std::atomic<int64_t>* read);

  const std::vector<FlatGroup>& groups() const { return plan_.groups; }
  const OptimizerStagePlan& plan() const { return plan_; }

  // Writes elements [begin, begin + n) of state `s`'s flat buffer of group
  // `g`, noting the bytes copied as they lie in a source file in `spans`.
  Status Produce(int g, int s, int64_t begin, int64_t n, uint8_t* dst, const SpanSink& spans) const;

 private:
  OptimizerStagePlan plan_;
  std::vector<std::vector<std::vector<SourceTensor>>> sources_;  // [group][slot][state]
  bool masters_ = false;  // state 0 is the fp32 master, planned like the weight
  std::atomic<int64_t>* read_ = nullptr;
};

Result<std::shared_ptr<const TargetStage>> TargetStage::Make(const SourceOptimizer& opt,
                                                             const OptimizerStagePlan& plan,
                                                             std::atomic<int64_t>* read) {
  auto t = std::make_shared<TargetStage>();
  t->plan_ = plan;
  t->masters_ = opt.HasMasters();
  t->read_ = read;
  for (const std::vector<OptimizerSlotPlan>& group : plan.slots) {
    t->sources_.emplace_back();
    for (const OptimizerSlotPlan& slot : group) {
      std::vector<SourceTensor> states;
      for (const std::string& state : opt.states()) {
        SourceTensor source;
        for (int tp = 0; tp < opt.tp(); ++tp) {
          RESHARD_ASSIGN_OR_RETURN(SourceShard shard, opt.Locate(slot.source_param, tp, state));
          source.shards.push_back(std::move(shard));
        }
        states.push_back(std::move(source));
      }
      t->sources_.back().push_back(std::move(states));
    }
  }
  return std::shared_ptr<const TargetStage>(std::move(t));
}

Status TargetStage::Produce(int g, int s, int64_t begin, int64_t n, uint8_t* dst, const SpanSink& spans) const {
  TouchedPages pages;
  int64_t read = 0, filled = 0;
  // Parameters lie back to back, so the fragments fill [0, filled) ...
  for (const Fragment& f : plan_.groups[g].FragmentsIn(begin, begin + n)) {
    const OptimizerSlotPlan& slot = plan_.slots[g][f.slot];
    read += MaterializeRange(sources_[g][f.slot][s], s == 0 && masters_ ? slot.master : slot.moment,
                             f.param_offset, f.param_offset + f.numel,
                             dst + f.partition_start * 4, &pages, spans);
    filled = f.partition_start + f.numel;
  }
  // ... and the rest is the alignment tail, which is 0.
  std::memset(dst + filled * 4, 0, static_cast<size_t>(n - filled) * 4);
  *read_ += read;
  return Status::Ok();
}

// An fp32 tensor of `shape` holding elements [start, start + its numel) of
// state `s`'s flat buffer of group `g`, produced while it is written.
Value FlatSlice(std::shared_ptr<const TargetStage> stage, int g, int s, int64_t start,
                const std::vector<int64_t>& shape) {
  return MakeProducedTensor(
      DType::kFloat32, shape,
      ByteProducer::Traced([stage = std::move(stage), g, s, start](int64_t offset, int64_t length, uint8_t* dst,
                                                                   const SpanSink& spans) {
        if (offset % 4 != 0 || length % 4 != 0) {
          return Status::Internal("optimizer state requested in a range not of whole elements");
        }
        return stage->Produce(g, s, start + offset / 4, length / 4, dst, spans);
      }));
}

// A fragment_address like the source's, with new numbers.
Value FragmentAddress(const Value& like, int64_t numel, int64_t start) {
  Value address = like;
  Set(address, "numel", Value::Int(numel));
  Set(address, "start", Value::Int(start));
  return address;
}

const Value* FirstFragmentAddress(const Value& osd) {
  const Value* all = Find(osd, "param_slice_mappings");
  if (all == nullptr || !all->is(Value::Kind::kList)) return nullptr;
  for (const Value& group : all->as_list().items) {
    const Items* items = DictItems(group);
    if (items != nullptr && !items->empty()) return &items->front().second;
  }
  return nullptr;
}

Value SliceMappings(const TargetStage& stage, int d, const Value& address_like) {
  std::vector<Value> groups;
  for (size_t g = 0; g < stage.groups().size(); ++g) {
    const FlatGroup& group = stage.groups()[g];
    Items items;
    for (const Fragment& frag : group.Fragments(stage.plan().PartitionOf(static_cast<int>(g), d))) {
      items.emplace_back(Value::String(group.slots()[frag.slot].name),
                         FragmentAddress(address_like, frag.numel, frag.partition_start));
    }
    groups.push_back(MakeOrderedDict(std::move(items)));
  }
  return Value::MakeList(std::move(groups));
}

// DP rank `d`'s shard: the template `like` with the layout fields replaced.
Result<Value> BuildShard(const SourceOptimizer& opt, const Value& like,
                         const std::shared_ptr<const TargetStage>& stage, int d) {
  const OptimizerFormat& format = opt.format();
  Value root = like;
  Value& osd = *FindMutable(root, "optimizer_state_dict");
  std::vector<Value> masters, paddings, counts;
  for (size_t g = 0; g < stage->groups().size(); ++g) {
    const FlatGroup& group = stage->groups()[g];
    const int part = stage->plan().PartitionOf(static_cast<int>(g), d);
    const int64_t start = part * group.partition();
    Value* state = MutableTorchGroupState(FindMutable(osd, "base_optimizer_state"), static_cast<int>(g));
    if (state == nullptr && opt.states().size() > 1) {
      return Status::Internal("the template shard has no state for group " + std::to_string(g));
    }
    for (size_t s = 1; s < opt.states().size(); ++s) {
      Set(*state, opt.states()[s],
          FlatSlice(stage, static_cast<int>(g), static_cast<int>(s), start, {group.partition()}));
    }
    // ZeRO-1/2 store the master partition without its alignment padding.
    const int64_t master_len = format.zero ? group.partition() - group.PaddingIn(part) : group.partition();
    masters.push_back(FlatSlice(stage, static_cast<int>(g), 0, start, {master_len}));
    // BF16_Optimizer records the whole padding on the last rank; ZeRO each rank's share.
    const int64_t padding = format.zero ? group.PaddingIn(part)
                                        : (part == group.dp() - 1 ? group.padded() - group.numel() : 0);
    paddings.push_back(Value::Int(padding));
    counts.push_back(Value::Int(group.dp()));
  }
  Set(osd, "single_partition_of_fp32_groups", Value::MakeList(std::move(masters)));
  Set(osd, format.padding_key, Value::MakeList(std::move(paddings)));
  Set(osd, "partition_count", Value::MakeList(std::move(counts)));
  if (format.slice_mappings) {
    const Value* address = FirstFragmentAddress(*Find(like, "optimizer_state_dict"));
    if (address == nullptr) return Status::Internal("the template shard has no fragment_address to copy");
    Set(osd, "param_slice_mappings", SliceMappings(*stage, d, *address));
  }
  return root;
}

// The FP16_Optimizer dict of an mp_rank file: whole flats, no partitions.
Result<Value> BuildEmbedded(const SourceOptimizer& opt, const std::shared_ptr<const TargetStage>& stage) {
  Value optimizer = opt.Template();
  Value* torch_state = FindMutable(optimizer, "optimizer_state_dict");
  std::vector<Value> masters;
  for (size_t g = 0; g < stage->groups().size(); ++g) {
    const int64_t n = stage->groups()[g].numel();
    Value* state = MutableTorchGroupState(torch_state, static_cast<int>(g));
    if (state == nullptr && opt.states().size() > 1) {
      return Status::Internal("the template optimizer has no state for group " + std::to_string(g));
    }
    for (size_t s = 1; s < opt.states().size(); ++s) {
      Set(*state, opt.states()[s], FlatSlice(stage, static_cast<int>(g), static_cast<int>(s), 0, {n}));
    }
    masters.push_back(FlatSlice(stage, static_cast<int>(g), 0, 0, {n}));
  }
  Set(optimizer, "fp32_groups_flat", Value::MakeList(std::move(masters)));
  return optimizer;
}

// One target parameter's state: the source's first parameter's (key order,
// scalar states) with its per-element states produced from slot `slot` of group `g`.
Value ParamState(const SourceOptimizer& opt, const std::shared_ptr<const TargetStage>& stage,
                 const Value& like, int g, int slot) {
  const FlatSlot& flat = stage->groups()[g].slots()[slot];
  Value state = like;
  for (auto& [key, value] : *MutableDictItems(state)) {
    const auto s = std::find(opt.states().begin(), opt.states().end(),
                             key.is(Value::Kind::kString) ? key.as_string() : "");
    value = s == opt.states().end()
                ? WithOwnStorage(value)  // torch updates scalar states such as `step` in place
                : FlatSlice(stage, g, static_cast<int>(s - opt.states().begin()), flat.offset, flat.shape);
  }
  return state;
}

// A torch optimizer state_dict of an mp_rank file: per parameter, indexed
// across the target stage's groups in order; every group's hyperparameters
// are those of `templ`'s group (the source's), its first state the form of each.
Result<Value> BuildTorchState(const SourceOptimizer& opt, const Value& templ,
                              const std::shared_ptr<const TargetStage>& stage) {
  Value optimizer = templ;
  const Value* like = TorchGroupState(&templ, 0);  // null before the first step
  Items* state = MutableDictItems(*FindMutable(optimizer, "state"));
  std::vector<Value>& groups = FindMutable(optimizer, "param_groups")->as_list().items;
  if (state == nullptr || groups.size() != stage->groups().size()) {
    return Status::Internal("the template optimizer does not have the target stage's groups");
  }
  state->clear();
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<Value> params;
    for (size_t s = 0; s < stage->groups()[g].slots().size(); ++s, ++index) {
      if (like != nullptr) {
        state->emplace_back(Value::Int(index), ParamState(opt, stage, *like, static_cast<int>(g), static_cast<int>(s)));
      }
      params.push_back(Value::Int(index));
    }
    Set(groups[g], "params", Value::MakeList(std::move(params)));
  }
  return optimizer;
}

}  // namespace

Result<std::vector<Value>> BuildOptimizerState(const SourceOptimizer& opt,
                                               const OptimizerStagePlan& plan, int dp,
                                               std::atomic<int64_t>* read, const Value* like) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const TargetStage> stage,
                           TargetStage::Make(opt, plan, read));
  if (opt.format().embedded) {
    RESHARD_ASSIGN_OR_RETURN(Value optimizer, opt.format().per_parameter
                                                  ? BuildTorchState(opt, like != nullptr ? *like : opt.Template(), stage)
                                                  : BuildEmbedded(opt, stage));
    return std::vector<Value>{std::move(optimizer)};
  }
  std::vector<Value> shards;
  for (int d = plan.ep_rank; d < dp; d += plan.ep) {
    RESHARD_ASSIGN_OR_RETURN(Value shard, BuildShard(opt, like != nullptr ? *like : opt.Template(), stage, d));
    shards.push_back(std::move(shard));
  }
  return shards;
}

}  // namespace reshard
