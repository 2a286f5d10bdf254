#include "optim/optimizer_writer.h"

#include <cstring>
#include <map>

#include "exec/materialize.h"
#include "format/torch_file.h"
#include "layout/checkpoint_files.h"
#include "optim/state_tensor.h"
#include "optim/torch_state.h"

namespace reshard {
namespace {

// The flat buffers of one target (pipeline, tensor) rank: per state, per
// group. Shard tensors view them, so each byte is held once.
using Buffer = std::shared_ptr<std::vector<uint8_t>>;
struct StageFlats {
  std::vector<FlatGroup> groups;
  std::map<std::string, std::vector<Buffer>> flats;
};

// Writes `state` of parameter `name` as target TP rank `t` holds it into `dst`:
// the source TP ranks' copies, re-sharded by the plan of the parameter's weight.
Status TargetLocalState(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                        const Plan& plan, const std::string& name, int t,
                        const std::string& state, uint8_t* dst, int64_t* read) {
  if (!src.pipeline) {
    // The TP layout is unchanged: TP rank t's state is the source rank's own.
    RESHARD_ASSIGN_OR_RETURN(std::vector<uint8_t> same, opt.Gather(name, t, state));
    std::memcpy(dst, same.data(), same.size());
    *read += static_cast<int64_t>(same.size());
    return Status::Ok();
  }
  RESHARD_ASSIGN_OR_RETURN(StateTensor source, StateTensor::Gather(src, opt, name, state));
  // Layer files are planned layer by layer, TP rank by TP rank.
  TensorPlan tensor_plan =
      plan.layer_files[source.layer_index() * plan.tp + t].tensors[source.tensor_index()];
  // New vocabulary rows: the master takes the weights' fill, moments start at 0.
  if (state != kMasterState) {
    for (SliceFill& f : tensor_plan.fills) f.value = 0;
  }
  *read += MaterializeInto(source.tensor(), tensor_plan, dst);
  return Status::Ok();
}

Result<StageFlats> BuildStageFlats(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                   const Plan& plan, const ModelStatesPlan& stage, int64_t* read) {
  StageFlats f;
  const int dp = opt.format().embedded ? 1 : plan.dp;  // FP16_Optimizer does not partition
  for (const auto& params : stage.param_shapes) {
    f.groups.emplace_back(params, dp, opt.format().Alignment(dp));
  }
  if (static_cast<int>(f.groups.size()) != opt.num_groups()) {
    return Status::Unsupported("target stage " + std::to_string(stage.pp_rank) + " has " +
                               std::to_string(f.groups.size()) + " optimizer groups but the source has " +
                               std::to_string(opt.num_groups()));
  }
  for (const std::string& state : opt.states()) {
    auto& per_group = f.flats[state];
    for (const FlatGroup& group : f.groups) {
      // Zero-initialised: the alignment tail stays 0.
      per_group.push_back(std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(group.padded()) * 4, 0));
      for (const FlatSlot& slot : group.slots()) {
        RESHARD_RETURN_IF_ERROR(TargetLocalState(src, opt, plan, slot.name, stage.tp_rank, state,
                                                 per_group.back()->data() + slot.offset * 4, read));
      }
    }
  }
  return f;
}

// A 1-D fp32 tensor viewing elements [start, start + numel) of `flat`.
Value FlatSlice(const Buffer& flat, int64_t start, int64_t numel) {
  return MakeTensorOver(DType::kFloat32, {numel},
                        ByteView{flat, flat->data() + start * 4, static_cast<size_t>(numel) * 4});
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

Value SliceMappings(const StageFlats& f, int d, const Value& address_like) {
  std::vector<Value> groups;
  for (const FlatGroup& group : f.groups) {
    Items items;
    for (const Fragment& frag : group.Fragments(d)) {
      items.emplace_back(Value::String(group.slots()[frag.slot].name),
                         FragmentAddress(address_like, frag.numel, frag.partition_start));
    }
    groups.push_back(MakeOrderedDict(std::move(items)));
  }
  return Value::MakeList(std::move(groups));
}

// DP rank `d`'s shard: the source template with the layout fields replaced.
Result<Value> BuildShard(const SourceOptimizer& opt, const StageFlats& f, int d) {
  const OptimizerFormat& format = opt.format();
  Value root = opt.Template();
  Value& osd = *FindMutable(root, "optimizer_state_dict");
  std::vector<Value> masters, paddings, counts;
  for (size_t g = 0; g < f.groups.size(); ++g) {
    const FlatGroup& group = f.groups[g];
    const int64_t start = d * group.partition();
    Value* state = MutableTorchGroupState(FindMutable(osd, "base_optimizer_state"), static_cast<int>(g));
    if (state == nullptr && opt.states().size() > 1) {
      return Status::Internal("the template shard has no state for group " + std::to_string(g));
    }
    for (size_t s = 1; s < opt.states().size(); ++s) {
      Set(*state, opt.states()[s], FlatSlice(f.flats.at(opt.states()[s])[g], start, group.partition()));
    }
    // ZeRO-1/2 store the master partition without its alignment padding.
    const int64_t master_len = format.zero ? group.partition() - group.PaddingIn(d) : group.partition();
    masters.push_back(FlatSlice(f.flats.at(kMasterState)[g], start, master_len));
    // BF16_Optimizer records the whole padding on the last rank; ZeRO each rank's share.
    const int64_t padding = format.zero ? group.PaddingIn(d)
                                        : (d == group.dp() - 1 ? group.padded() - group.numel() : 0);
    paddings.push_back(Value::Int(padding));
    counts.push_back(Value::Int(group.dp()));
  }
  Set(osd, "single_partition_of_fp32_groups", Value::MakeList(std::move(masters)));
  Set(osd, format.padding_key, Value::MakeList(std::move(paddings)));
  Set(osd, "partition_count", Value::MakeList(std::move(counts)));
  if (format.slice_mappings) {
    const Value* like = FirstFragmentAddress(*Find(opt.Template(), "optimizer_state_dict"));
    if (like == nullptr) return Status::Internal("the template shard has no fragment_address to copy");
    Set(osd, "param_slice_mappings", SliceMappings(f, d, *like));
  }
  return root;
}

// The FP16_Optimizer dict of an mp_rank file: whole flats, no partitions.
Result<Value> BuildEmbedded(const SourceOptimizer& opt, const StageFlats& f) {
  Value optimizer = opt.Template();
  Value* torch_state = FindMutable(optimizer, "optimizer_state_dict");
  std::vector<Value> masters;
  for (size_t g = 0; g < f.groups.size(); ++g) {
    const int64_t n = f.groups[g].numel();
    Value* state = MutableTorchGroupState(torch_state, static_cast<int>(g));
    if (state == nullptr && opt.states().size() > 1) {
      return Status::Internal("the template optimizer has no state for group " + std::to_string(g));
    }
    for (size_t s = 1; s < opt.states().size(); ++s) {
      Set(*state, opt.states()[s], FlatSlice(f.flats.at(opt.states()[s])[g], 0, n));
    }
    masters.push_back(FlatSlice(f.flats.at(kMasterState)[g], 0, n));
  }
  Set(optimizer, "fp32_groups_flat", Value::MakeList(std::move(masters)));
  return optimizer;
}

}  // namespace

std::string OptimizerFileName(const OptimizerFormat& format, int dp_rank, int mp_rank) {
  return std::string(format.bf16_prefix ? "bf16_" : "") + "zero_pp_rank_" + std::to_string(dp_rank) +
         "_" + ModelStatesName(mp_rank) + "_optim_states.pt";
}

Result<std::vector<Value>> BuildOptimizerState(const LogicalCheckpoint& src,
                                               const SourceOptimizer& opt, const Plan& plan,
                                               int pp_rank, int tp_rank, int64_t* read) {
  const int mp = pp_rank * plan.tp + tp_rank;
  RESHARD_ASSIGN_OR_RETURN(StageFlats flats,
                           BuildStageFlats(src, opt, plan, plan.model_states[mp], read));
  if (opt.format().embedded) {
    RESHARD_ASSIGN_OR_RETURN(Value optimizer, BuildEmbedded(opt, flats));
    return std::vector<Value>{std::move(optimizer)};
  }
  std::vector<Value> shards;
  for (int d = 0; d < plan.dp; ++d) {
    RESHARD_ASSIGN_OR_RETURN(Value shard, BuildShard(opt, flats, d));
    shards.push_back(std::move(shard));
  }
  return shards;
}

Result<int64_t> WriteOptimizerShards(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                     const Plan& plan, int pp_rank, int tp_rank,
                                     const std::string& dir) {
  int64_t read = 0;
  RESHARD_ASSIGN_OR_RETURN(std::vector<Value> shards,
                           BuildOptimizerState(src, opt, plan, pp_rank, tp_rank, &read));
  for (size_t d = 0; d < shards.size(); ++d) {
    const std::string name = OptimizerFileName(opt.format(), static_cast<int>(d), pp_rank * plan.tp + tp_rank);
    RESHARD_RETURN_IF_ERROR(WriteTorchFile(dir + "/" + name, shards[d]));
  }
  return read;
}

}  // namespace reshard
