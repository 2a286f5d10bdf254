#include "formats/deepspeed/zero3/zero3_checkpoint.h"

#include <algorithm>
#include <cstring>

#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/model/stages.h"
#include "formats/deepspeed/files/torch_state.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "plan/materialize.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The torch optimizer state dict inside a ZeRO-3 optimizer file.
const Value* TorchStateDict(const Value& root) {
  const Value* osd = Find(root, "optimizer_state_dict");
  return osd != nullptr ? Find(*osd, "optimizer_state_dict") : nullptr;
}

const Value* SubGroupState(const Value& root, int sub_group) {
  return TorchGroupState(TorchStateDict(root), sub_group);
}

int64_t TensorNumel(const Value* v) {
  return v != nullptr && v->is(Value::Kind::kTensor) ? v->as_tensor().numel() : -1;
}

// Elements of a sub-group's flat on any rank: its parameters' slices.
int64_t FlatLength(const std::vector<Zero3Param>& params, int dp) {
  int64_t n = 0;
  for (const Zero3Param& p : params) n += CeilDiv(p.numel, dp);
  return n;
}

// DeepSpeed's sub-group cut: within one parameter group, close a sub-group once
// its partition elements reach `sub_group_size` (or at the group's end).
std::vector<std::vector<Zero3Param>> CutSubGroups(const std::vector<Zero3Param>& group, int dp,
                                                  int64_t sub_group_size) {
  if (sub_group_size >= FlatLength(group, dp)) return {group};
  std::vector<std::vector<Zero3Param>> out(1);
  int64_t size = 0;
  for (size_t i = 0; i < group.size(); ++i) {
    out.back().push_back(group[i]);
    size += CeilDiv(group[i].numel, dp);
    if (size >= sub_group_size && i + 1 < group.size()) {
      out.emplace_back();
      size = 0;
    }
  }
  return out;
}

int64_t IntOrFloat(const Value* v, int64_t fallback) {
  if (v == nullptr) return fallback;
  if (v->is(Value::Kind::kFloat)) return static_cast<int64_t>(v->as_float());
  int64_t out = fallback;
  ReadInt(*v, &out);
  return out;
}

}  // namespace

Result<std::unique_ptr<Zero3Checkpoint>> Zero3Checkpoint::Load(
    const CheckpointFiles& files, const std::set<std::string>& allowed_classes) {
  auto ckpt = std::unique_ptr<Zero3Checkpoint>(new Zero3Checkpoint());
  ckpt->files_ = files;
  const int mp = static_cast<int>(files.zero3_model_files.size());
  ckpt->dp_ = static_cast<int>(files.zero3_model_files.begin()->second.size());
  ckpt->ranks_.resize(mp);
  for (int m = 0; m < mp; ++m) RESHARD_RETURN_IF_ERROR(ckpt->LoadRank(m, allowed_classes));
  return ckpt;
}

Status Zero3Checkpoint::LoadRank(int mp, const std::set<std::string>& allowed_classes) {
  auto models = files_.zero3_model_files.find(mp);
  if (models == files_.zero3_model_files.end() || static_cast<int>(models->second.size()) != dp_ ||
      models->second.rbegin()->first != dp_ - 1) {
    return Status::InvalidInput(files_.tag_dir + ": ZeRO-3 model states of mp rank " +
                                std::to_string(mp) + " are missing for some DP ranks");
  }
  std::map<int, std::string> optim;
  for (const OptimizerShardFile& f : files_.optimizer_files) {
    if (f.mp_rank == mp) optim[f.dp_rank] = f.path;
  }
  if (static_cast<int>(optim.size()) != dp_ || optim.rbegin()->first != dp_ - 1) {
    return Status::InvalidInput(files_.tag_dir + ": ZeRO-3 optimizer shards of mp rank " +
                                std::to_string(mp) + " do not cover DP ranks 0-" + std::to_string(dp_ - 1));
  }
  Zero3Rank& rank = ranks_[mp];
  for (int d = 0; d < dp_; ++d) {
    RESHARD_ASSIGN_OR_RETURN(Value model, ReadDeepSpeedFile(models->second[d], allowed_classes));
    RESHARD_ASSIGN_OR_RETURN(Value opt, ReadDeepSpeedFile(optim[d], allowed_classes));
    const Value* frozen = Find(model, "frozen_param_fragments");
    const Items* frozen_items = frozen != nullptr ? DictItems(*frozen) : nullptr;
    if (frozen_items != nullptr && !frozen_items->empty()) {
      return Status::Unsupported(BaseName(models->second[d]) +
                                 " has frozen parameters, whose ZeRO-3 fragments reshard does not "
                                 "re-slice yet");
    }
    rank.model_states.push_back(std::move(model));
    rank.optimizer.push_back(std::move(opt));
  }
  std::vector<std::vector<ParamShape>> shapes;
  if (!ReadParamShapes(rank.model_states[0], &shapes) || shapes.empty()) {
    return Status::InvalidInput(BaseName(models->second[0]) + " records no param_shapes");
  }
  for (const auto& group : shapes) {
    std::vector<Zero3Param> params;
    int64_t offset = 0;
    for (const auto& [name, shape] : group) {
      params.push_back({name, shape, ShapeNumel(shape)});
      rank.slots[name] = {static_cast<int>(rank.sub_groups.size()), offset, params.back().numel};
      offset += CeilDiv(params.back().numel, dp_);
    }
    rank.sub_groups.push_back(std::move(params));
  }
  const Value* torch_sd = TorchStateDict(rank.optimizer[0]);
  const Value* groups = torch_sd != nullptr ? Find(*torch_sd, "param_groups") : nullptr;
  if (groups == nullptr || !groups->is(Value::Kind::kList)) {
    return Status::InvalidInput(BaseName(optim[0]) + " has no ZeRO-3 optimizer param_groups");
  }
  for (const Value& g : groups->as_list().items) {
    std::vector<int64_t> ids;
    const Value* params = Find(g, "params");
    if (params == nullptr || !ReadIntSequence(*params, &ids)) {
      return Status::InvalidInput(BaseName(optim[0]) + ": a param group lists no sub-groups");
    }
    for (int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(rank.sub_groups.size())) {
        return Status::InvalidInput(BaseName(optim[0]) + ": a param group lists sub-group " +
                                    std::to_string(id) + ", but param_shapes has " +
                                    std::to_string(rank.sub_groups.size()));
      }
    }
    rank.group_sub_groups.emplace_back(ids.begin(), ids.end());
  }
  if (mp == 0) {
    const Value* config = Find(rank.model_states[0], "ds_config");
    const Value* zero = config != nullptr ? Find(*config, "zero_optimization") : nullptr;
    sub_group_size_ = IntOrFloat(zero != nullptr ? Find(*zero, "sub_group_size") : nullptr, sub_group_size_);
    states_ = {kMasterState};
    if (const Value* first = SubGroupState(rank.optimizer[0], 0); first != nullptr && DictItems(*first)) {
      const int64_t flat = FlatLength(rank.sub_groups[0], dp_);
      for (const auto& [k, v] : *DictItems(*first)) {
        if (k.is(Value::Kind::kString) && TensorNumel(&v) == flat) states_.push_back(k.as_string());
      }
    }
  }
  for (int d = 0; d < dp_; ++d) {
    for (size_t sg = 0; sg < rank.sub_groups.size(); ++sg) {
      const int64_t want = FlatLength(rank.sub_groups[sg], dp_);
      for (const std::string& state : states_) {
        if (TensorNumel(Flat(mp, d, static_cast<int>(sg), state)) != want) {
          return Status::InvalidInput(BaseName(optim[d]) + ": '" + state + "' of sub-group " +
                                      std::to_string(sg) + " is not the " + std::to_string(want) +
                                      " elements param_shapes and DP " + std::to_string(dp_) + " give");
        }
      }
    }
  }
  return Status::Ok();
}

const Value* Zero3Checkpoint::Flat(int mp, int d, int sub_group, const std::string& state) const {
  const Value& root = ranks_[mp].optimizer[d];
  if (state == kMasterState) {
    const Value* osd = Find(root, "optimizer_state_dict");
    const Value* flats = osd != nullptr ? Find(*osd, "fp32_flat_groups") : nullptr;
    if (flats == nullptr || !flats->is(Value::Kind::kList) ||
        sub_group >= static_cast<int>(flats->as_list().items.size())) {
      return nullptr;
    }
    return &flats->as_list().items[sub_group];
  }
  const Value* st = SubGroupState(root, sub_group);
  return st != nullptr ? Find(*st, state) : nullptr;
}

int64_t Zero3Checkpoint::iteration() const {
  return IntOrFloat(Find(ranks_[0].model_states[0], "global_steps"), 0);
}

Result<SourceShard> Zero3Checkpoint::Locate(int mp, const std::string& name,
                                            const std::string& state) const {
  const Zero3Rank& rank = ranks_[mp];
  auto at = rank.slots.find(name);
  if (at == rank.slots.end()) return Status::InvalidInput("parameter " + name + " is not in the ZeRO-3 param_shapes");
  const Zero3Slot& slot = at->second;
  const int64_t slice = CeilDiv(slot.numel, dp_);
  SourceShard shard;
  shard.at = ShardCoords{mp};
  for (int d = 0; d < dp_; ++d) {
    const int64_t n = std::min(slice, slot.numel - d * slice);
    if (n <= 0) break;
    const Tensor& flat = Flat(mp, d, slot.sub_group, state)->as_tensor();
    const ByteView& file = flat.storage->bytes;
    shard.runs.push_back({d * slice, n, ByteView{file.owner, TensorData(flat) + slot.offset * 4,
                                                 static_cast<size_t>(n) * 4, file.mapped}});
  }
  return shard;
}

std::string Zero3Checkpoint::Summary() const {
  std::string states;
  for (const std::string& s : states_) states += (states.empty() ? "" : ", ") + s;
  return "ZeRO-3 checkpoint (no layer files; only DP can change); TP " + std::to_string(mp()) +
         ", DP " + std::to_string(dp_) + "; iteration " + std::to_string(iteration()) + "; " +
         std::to_string(ranks_[0].sub_groups.size()) + " sub-groups in " +
         std::to_string(ranks_[0].group_sub_groups.size()) + " parameter groups; states " + states;
}

// The target layout of one model-parallel rank at a new DP size.
struct Zero3Target {
  int dp = 1;
  std::vector<std::vector<Zero3Param>> sub_groups;
  std::vector<std::vector<int64_t>> group_ids;  // param group -> its sub-group ids
  std::vector<int> scalar_source;                // source sub-group lending scalars (step)
};

Zero3Target Zero3Checkpoint::Retarget(int mp, int target_dp) const {
  const Zero3Rank& rank = ranks_[mp];
  Zero3Target t;
  t.dp = target_dp;
  for (const std::vector<int>& ids : rank.group_sub_groups) {
    std::vector<Zero3Param> params;
    for (int id : ids) params.insert(params.end(), rank.sub_groups[id].begin(), rank.sub_groups[id].end());
    t.group_ids.emplace_back();
    for (auto& cut : CutSubGroups(params, target_dp, sub_group_size_)) {
      t.group_ids.back().push_back(static_cast<int64_t>(t.sub_groups.size()));
      t.sub_groups.push_back(std::move(cut));
      t.scalar_source.push_back(ids.empty() ? 0 : ids[0]);
    }
  }
  return t;
}

namespace {

// The source DP rank whose model states target DP rank `d`'s are made
// from: DP rank 0's file keeps rank-0-only fields (shared_params).
int ModelStatesTemplate(int d, int source_dp) { return d == 0 ? 0 : std::min(1, source_dp - 1); }

}  // namespace

Value Zero3Checkpoint::TargetModelStates(int mp, const Zero3Target& t, int d) const {
  Value model = ranks_[mp].model_states[ModelStatesTemplate(d, dp_)];
  Set(model, "dp_world_size", Value::Int(t.dp));
  std::vector<Value> shapes;
  for (const auto& group : t.sub_groups) {
    Items items;
    for (const Zero3Param& p : group) items.emplace_back(Value::String(p.name), MakeTorchSize(p.shape));
    shapes.push_back(MakeOrderedDict(std::move(items)));
  }
  Set(model, "param_shapes", Value::MakeList(std::move(shapes)));
  return model;
}

Value Zero3Checkpoint::FlatTensor(int mp, const std::shared_ptr<const Zero3Target>& target, size_t sg,
                                  const std::string& state, int d, std::atomic<int64_t>* read) const {
  auto produce = [this, mp, target, sg, state, d, read](int64_t offset, int64_t length, uint8_t* dst) -> Status {
    int64_t begin = 0, end = 0;
    RESHARD_RETURN_IF_ERROR(ElementRange(offset, length, 4, &begin, &end));
    const std::vector<Zero3Param>& sub_group = target->sub_groups[sg];
    const int dp = target->dp;
    TouchedPages pages;
    int64_t at = 0;  // where the current parameter's slice starts in the flat
    for (size_t i = 0; i < sub_group.size() && at < end; ++i) {
      const int64_t slice = CeilDiv(sub_group[i].numel, dp);
      const int64_t held = std::clamp<int64_t>(sub_group[i].numel - d * slice, 0, slice);
      const int64_t lo = std::max(begin, at), hi = std::min(end, at + slice);
      const int64_t data_hi = std::min(hi, at + held);
      if (lo < data_hi) {
        RESHARD_ASSIGN_OR_RETURN(const SourceShard source, Locate(mp, sub_group[i].name, state));
        source.Copy(d * slice + (lo - at), data_hi - lo, 4, dst + (lo - begin) * 4, &pages);
        *read += (data_hi - lo) * 4;
      }
      const int64_t zero_lo = std::max(lo, data_hi);
      if (zero_lo < hi) std::memset(dst + (zero_lo - begin) * 4, 0, static_cast<size_t>(hi - zero_lo) * 4);
      at += slice;
    }
    return Status::Ok();
  };
  return MakeProducedTensor(DType::kFloat32, {FlatLength(target->sub_groups[sg], target->dp)}, std::move(produce));
}

Value Zero3Checkpoint::TargetOptimizer(int mp, const std::shared_ptr<const Zero3Target>& target, int d,
                                       std::atomic<int64_t>* read) const {
  const Zero3Target& t = *target;
  const Value& source = ranks_[mp].optimizer[0];
  Value opt = source;
  Value& osd = *FindMutable(opt, "optimizer_state_dict");
  Set(osd, "partition_count", Value::Int(t.dp));
  Items state_items;
  std::vector<Value> masters;
  for (size_t sg = 0; sg < t.sub_groups.size(); ++sg) {
    Value per_group = *SubGroupState(source, t.scalar_source[sg]);
    for (size_t s = 1; s < states_.size(); ++s) {
      Set(per_group, states_[s], FlatTensor(mp, target, sg, states_[s], d, read));
    }
    state_items.emplace_back(Value::Int(static_cast<int64_t>(sg)), std::move(per_group));
    masters.push_back(FlatTensor(mp, target, sg, kMasterState, d, read));
  }
  Value& torch_sd = *FindMutable(osd, "optimizer_state_dict");
  Set(torch_sd, "state", Value::MakeDict(std::move(state_items)));
  Value& groups = *FindMutable(torch_sd, "param_groups");
  for (size_t g = 0; g < groups.as_list().items.size(); ++g) {
    std::vector<Value> ids;
    for (int64_t id : t.group_ids[g]) ids.push_back(Value::Int(id));
    Set(groups.as_list().items[g], "params", Value::MakeList(std::move(ids)));
  }
  Set(osd, "fp32_flat_groups", Value::MakeList(std::move(masters)));
  return opt;
}

namespace {

// Where DP rank `d`'s flat tensor of `state` of sub-group `sg` comes from,
// for --dry-run: its slice of each parameter, from the source's partitions.
std::string FlatFrom(const Zero3Target& t, size_t sg, const std::string& state, int d, int source_dp) {
  const std::vector<Zero3Param>& params = t.sub_groups[sg];
  std::string names = params.empty() ? "" : " (" + params.front().name + (params.size() > 1 ? " ... " + params.back().name : "") + ")";
  return "optimizer " + state + ": slice " + std::to_string(d) + " of " + std::to_string(t.dp) + " of each of " +
         Count(static_cast<int64_t>(params.size()), "parameter") + names + ", from the source's " +
         std::to_string(source_dp) + " DP partitions";
}

}  // namespace

Result<std::vector<PlannedFile>> Zero3Checkpoint::Files(int target_dp, bool bf16_prefix,
                                                       std::atomic<int64_t>* read) const {
  // Each file's tree is built while the file is written: a tree per target
  // file held at once would grow with the parameters times the DP size.
  std::vector<PlannedFile> files;
  for (int mp = 0; mp < this->mp(); ++mp) {
    auto target = std::make_shared<const Zero3Target>(Retarget(mp, target_dp));
    for (int d = 0; d < target_dp; ++d) {
      const std::string rank = "mp rank " + std::to_string(mp) + ", DP rank " + std::to_string(d);
      RESHARD_ASSIGN_OR_RETURN(PlannedFile model, TorchFile(Zero3ModelStatesFileName(d, mp), "model states of " + rank,
                                                            [this, mp, target, d] {
                                                              return Result<Value>(TargetModelStates(mp, *target, d));
                                                            }));
      RESHARD_ASSIGN_OR_RETURN(PlannedFile optimizer,
                               TorchFile(OptimizerFileName(bf16_prefix, d, mp), "optimizer partition of " + rank,
                                         [this, mp, target, d, read] {
                                           return Result<Value>(TargetOptimizer(mp, target, d, read));
                                         }));
      // ZeRO-3 keeps no pipeline: the mp rank is the TP rank.
      optimizer.roles.push_back(FileRole{FileRole::Holds::kOptimizer, mp, 0, d, "", ""});
      const std::string saved = "as the source's DP rank " + std::to_string(ModelStatesTemplate(d, dp_)) + " saved it";
      for (PlannedTensor& t : model.tensors) t.from = saved;
      for (size_t sg = 0; sg < target->sub_groups.size(); ++sg) {
        const std::string group = std::to_string(sg);
        SetFrom(&optimizer, "optimizer_state_dict/fp32_flat_groups/" + group, FlatFrom(*target, sg, kMasterState, d, dp_));
        for (size_t s = 1; s < states_.size(); ++s) {
          SetFrom(&optimizer, "optimizer_state_dict/optimizer_state_dict/state/" + group + "/" + states_[s],
                  FlatFrom(*target, sg, states_[s], d, dp_));
        }
      }
      SetUnsaidFrom(&optimizer, "", "the source's optimizer step");  // the per-sub-group steps
      files.push_back(std::move(model));
      files.push_back(std::move(optimizer));
    }
  }
  return files;
}

}  // namespace reshard
