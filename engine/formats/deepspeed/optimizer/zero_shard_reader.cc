#include "formats/deepspeed/optimizer/zero_shard_reader.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/files/torch_state.h"
#include "formats/deepspeed/model/stages.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Where each format keeps things. A sharded file's root holds
// optimizer_state_dict {base_optimizer_state: torch state dict,
// single_partition_of_fp32_groups: [...]}; an embedded FP16_Optimizer dict
// holds {optimizer_state_dict: torch state dict, fp32_groups_flat: [...]};
// the per-parameter format is a torch state dict itself.
const Value* OptimizerStateDict(const Value& shard) { return Find(shard, "optimizer_state_dict"); }

const Value* TorchStateDict(const Value& shard, bool embedded) {
  const Value* osd = OptimizerStateDict(shard);
  if (osd == nullptr || embedded) return osd;
  return Find(*osd, "base_optimizer_state");
}

const Value* MasterList(const Value& shard, bool embedded) {
  if (embedded) return Find(shard, "fp32_groups_flat");
  const Value* osd = OptimizerStateDict(shard);
  return osd != nullptr ? Find(*osd, "single_partition_of_fp32_groups") : nullptr;
}

// A contiguous 1-D fp32 tensor, or null.
const Tensor* FlatTensor(const Value* v) {
  if (v == nullptr || !v->is(Value::Kind::kTensor)) return nullptr;
  const Tensor& t = v->as_tensor();
  if (t.storage == nullptr || t.storage->dtype != DType::kFloat32 || t.sizes.size() != 1 ||
      !t.IsContiguous() || t.storage_offset + t.numel() > t.storage->numel) {
    return nullptr;
  }
  return &t;
}

const Tensor* MasterFlat(const Value& shard, bool embedded, int group) {
  const Value* list = MasterList(shard, embedded);
  if (list == nullptr || !list->is(Value::Kind::kList)) return nullptr;
  const auto& items = list->as_list().items;
  return group < static_cast<int>(items.size()) ? FlatTensor(&items[group]) : nullptr;
}


// A torch param group's `params` must be the indices [first, first + count).
bool HasIndices(const Value& group, int64_t first, size_t count) {
  const Value* params = Find(group, "params");
  if (params == nullptr || !params->is(Value::Kind::kList) || params->as_list().items.size() != count) {
    return false;
  }
  for (size_t i = 0; i < count; ++i) {
    int64_t index = -1;
    if (!ReadInt(params->as_list().items[i], &index) || index != first + static_cast<int64_t>(i)) return false;
  }
  return true;
}

// The refusal when a stage's torch optimizer does not hold the parameters
// the rule set and DeepSpeed's partition give it.
Status NotThisStage(const std::string& file, const std::string& what) {
  return Status::InvalidInput(
      file + ": " + what + " (the stage's parameters follow DeepSpeed's current stage partition "
      "and the rule set's optimizer_groups; a checkpoint partitioned or grouped otherwise cannot "
      "be read; --weights-only converts the weights alone)");
}

int64_t ObjectField(const Value& v, const char* field) {
  int64_t out = -1;
  if (const Value* f = Find(v, field)) ReadInt(*f, &out);
  return out;
}

// param_slice_mappings[group] must list exactly the fragments the flat layout gives.
Status CheckSliceMappings(const Value& osd, int group, const FlatGroup& layout, int d,
                          const std::string& file) {
  const Value* all = Find(osd, "param_slice_mappings");
  const Value* mapping = nullptr;
  if (all != nullptr && all->is(Value::Kind::kList) &&
      group < static_cast<int>(all->as_list().items.size())) {
    mapping = &all->as_list().items[group];
  }
  const Items* items = mapping != nullptr ? DictItems(*mapping) : nullptr;
  const std::vector<Fragment> expected = layout.Fragments(d);
  bool same = items != nullptr && items->size() == expected.size();
  for (size_t i = 0; same && i < expected.size(); ++i) {
    const auto& [name, address] = (*items)[i];
    same = name.is(Value::Kind::kString) &&
           name.as_string() == layout.slots()[expected[i].slot].name &&
           ObjectField(address, "numel") == expected[i].numel &&
           ObjectField(address, "start") == expected[i].partition_start;
  }
  if (same) return Status::Ok();
  return Status::InvalidInput(
      file + ": param_slice_mappings of group " + std::to_string(group) +
      " disagree with the flat layout param_shapes give (was the run using "
      "round_robin_gradients?); reshard cannot place these optimizer fragments");
}

// Checks one DP rank's flats of one group and records them in `flats`.
Status AddFlats(const Value& shard, const OptimizerFormat& format,
                const std::vector<std::string>& states, int g, const FlatGroup& layout, int d,
                const std::string& where,
                std::map<std::string, std::vector<std::vector<const Tensor*>>>* flats,
                int num_groups) {
  // ZeRO-1/2 store the master partition without its alignment padding.
  const int64_t want_master =
      format.zero ? layout.partition() - layout.PaddingIn(d) : layout.partition();
  const Tensor* master = MasterFlat(shard, format.embedded, g);
  if (master == nullptr || master->numel() != want_master) {
    return Status::InvalidInput(where + ": the fp32 partition of group " + std::to_string(g) +
                                " is not the " + std::to_string(want_master) +
                                " elements the stage's parameters and DP " +
                                std::to_string(layout.dp()) + " give");
  }
  (*flats)[kMasterState].resize(num_groups);
  (*flats)[kMasterState][g].push_back(master);
  const Value* group_state = TorchGroupState(TorchStateDict(shard, format.embedded), g);
  for (size_t s = 1; s < states.size(); ++s) {
    const Tensor* flat = FlatTensor(group_state != nullptr ? Find(*group_state, states[s]) : nullptr);
    if (flat == nullptr || flat->numel() != layout.partition()) {
      return Status::InvalidInput(where + ": optimizer state '" + states[s] + "' of group " +
                                  std::to_string(g) + " is missing or not " +
                                  std::to_string(layout.partition()) + " fp32 elements");
    }
    (*flats)[states[s]].resize(num_groups);
    (*flats)[states[s]][g].push_back(flat);
  }
  return Status::Ok();
}

}  // namespace

bool HasEmbeddedOptimizerState(const LogicalCheckpoint& src) {
  const Value* embedded = src.metadata.empty() ? nullptr : Find(src.metadata[0], "optimizer");
  return embedded != nullptr && !embedded->is_none();
}

Result<std::unique_ptr<SourceOptimizer>> ShardOptimizer::Load(
    const LogicalCheckpoint& src, const std::vector<OptimizerShardFile>& files,
    const std::set<std::string>& allowed_classes) {
  auto opt = std::unique_ptr<ShardOptimizer>(new ShardOptimizer());
  opt->tp_ = src.tp;
  opt->stages_.resize(src.metadata.size());
  if (files.empty()) {
    // Without ZeRO (FP16_Optimizer, or a torch optimizer for fp32) the state
    // is in the mp_rank files, which record no param_shapes: the stage
    // layout is DeepSpeed's partition.
    opt->format_.embedded = true;
    RESHARD_ASSIGN_OR_RETURN(std::vector<int> bounds,
                             TargetStageBounds(src, src.pp, src.tp, src.vocab.padded_rows, {}));
    for (size_t mp = 0; mp < src.metadata.size(); ++mp) {
      RESHARD_RETURN_IF_ERROR(opt->LoadEmbeddedStage(src, static_cast<int>(mp), bounds));
    }
  } else {
    std::vector<std::vector<std::string>> paths(src.metadata.size());
    for (const OptimizerShardFile& f : files) {
      auto& by_dp = paths[f.mp_rank];
      if (static_cast<int>(by_dp.size()) <= f.dp_rank) by_dp.resize(f.dp_rank + 1);
      by_dp[f.dp_rank] = f.path;
    }
    for (size_t mp = 0; mp < src.metadata.size(); ++mp) {
      RESHARD_RETURN_IF_ERROR(opt->LoadStage(src, static_cast<int>(mp), paths[mp], allowed_classes));
    }
  }
  // Owners: the first pipeline stage holding a name (TP rank 0's view).
  for (int p = src.pp - 1; p >= 0; --p) {
    const auto& groups = opt->stages_[p * src.tp].groups;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t s = 0; s < groups[g].slots().size(); ++s) {
        opt->owner_[groups[g].slots()[s].name] = {p, static_cast<int>(g), static_cast<int>(s)};
      }
    }
  }
  return std::unique_ptr<SourceOptimizer>(std::move(opt));
}

// DeepSpeed's round_robin_gradients flattens parameters in an order that
// param_shapes does not record: the fragments cannot be placed.
Status CheckFlatteningOrder(const Value& shard, const std::string& file) {
  const Value* config = Find(shard, "ds_config");
  const Value* zero = config != nullptr ? Find(*config, "zero_optimization") : nullptr;
  const Value* round_robin = zero != nullptr ? Find(*zero, "round_robin_gradients") : nullptr;
  if (round_robin != nullptr && round_robin->is(Value::Kind::kBool) && round_robin->as_bool()) {
    return Status::Unsupported(file + " was saved with zero_optimization.round_robin_gradients, whose "
                               "flattening order reshard cannot reconstruct");
  }
  return Status::Ok();
}

// Everything but the partitions must agree across shards of one save: the
// hyperparameters and step of every group, and per-group scalar state.
Status ShardOptimizer::CheckSameScalars(const Value& first, const Value& shard,
                                         const std::string& file) const {
  const Value* a = TorchStateDict(first, format_.embedded);
  const Value* b = TorchStateDict(shard, format_.embedded);
  const Value* groups_a = a != nullptr ? Find(*a, "param_groups") : nullptr;
  const Value* groups_b = b != nullptr ? Find(*b, "param_groups") : nullptr;
  bool same = groups_a != nullptr && groups_b != nullptr &&
              groups_a->DebugString(1 << 20) == groups_b->DebugString(1 << 20);
  for (int g = 0; same && g < num_groups_; ++g) {
    const Value* sa = TorchGroupState(a, g);
    const Value* sb = TorchGroupState(b, g);
    const Items* items = sa != nullptr ? DictItems(*sa) : nullptr;
    for (size_t i = 0; same && items != nullptr && i < items->size(); ++i) {
      const auto& [key, value] = (*items)[i];
      if (!key.is(Value::Kind::kString) ||
          std::find(states_.begin(), states_.end(), key.as_string()) != states_.end()) {
        continue;  // per-element states differ by design
      }
      const Value* other = sb != nullptr ? Find(*sb, key.as_string()) : nullptr;
      same = other != nullptr && ScalarBytes(value) == ScalarBytes(*other);
    }
  }
  if (same) return Status::Ok();
  return Status::InvalidInput(file + " records other optimizer hyperparameters or another step "
                              "than the first shard; the folder mixes shards of different saves");
}

Status ShardOptimizer::DetectFormat(const Value& shard, const FlatGroup& first_group,
                                     const std::string& path) {
  const Value& osd = *OptimizerStateDict(shard);
  format_.zero = Find(osd, "zero_stage") != nullptr;
  format_.slice_mappings = Find(osd, "param_slice_mappings") != nullptr;
  format_.bf16_prefix = BaseName(path).rfind("bf16_", 0) == 0;
  if (Find(osd, "group_paddings") != nullptr) {
    format_.padding_key = "group_paddings";
  } else if (Find(osd, "groups_padding") != nullptr) {
    format_.padding_key = "groups_padding";
  } else {
    return Status::Unsupported(BaseName(path) + " has no group_paddings; reshard does not know this optimizer format");
  }
  DetectStates(shard, first_group);
  return Status::Ok();
}

void ShardOptimizer::DetectStates(const Value& shard, const FlatGroup& first_group) {
  states_ = {kMasterState};
  const Value* state = TorchGroupState(TorchStateDict(shard, format_.embedded), 0);
  if (state == nullptr || DictItems(*state) == nullptr) return;
  for (const auto& [k, v] : *DictItems(*state)) {
    const Tensor* t = FlatTensor(&v);
    if (k.is(Value::Kind::kString) && t != nullptr && t->numel() == first_group.partition()) {
      states_.push_back(k.as_string());
    }
  }
}

Status ShardOptimizer::CheckGroupCount(size_t groups, int mp) {
  if (mp == 0) num_groups_ = static_cast<int>(groups);
  if (static_cast<int>(groups) == num_groups_ && num_groups_ > 0) return Status::Ok();
  return Status::Unsupported(ModelStatesFileName(mp) + " has " + std::to_string(groups) +
                             " parameter groups but " + ModelStatesFileName(0) + " has " +
                             std::to_string(num_groups_) +
                             "; reshard needs the same non-empty groups on every stage");
}

Status ShardOptimizer::LoadStage(const LogicalCheckpoint& src, int mp,
                                  const std::vector<std::string>& paths,
                                  const std::set<std::string>& allowed_classes) {
  Stage& stage = stages_[mp];
  std::vector<std::vector<ParamShape>> groups;
  if (!ReadParamShapes(src.metadata[mp], &groups)) {
    return Status::Unsupported(ModelStatesFileName(mp) +
                               " records no param_shapes, so its optimizer shards cannot be read");
  }
  RESHARD_RETURN_IF_ERROR(CheckGroupCount(groups.size(), mp));
  const int dp = static_cast<int>(paths.size());
  for (const auto& g : groups) stage.groups.emplace_back(g, dp, format_.Alignment(dp));
  for (int d = 0; d < dp; ++d) {
    RESHARD_ASSIGN_OR_RETURN(Value shard, ReadDeepSpeedFile(paths[d], allowed_classes));
    const Value* base = TorchStateDict(shard, false);
    if (base == nullptr) {
      return Status::InvalidInput(paths[d] + " has no optimizer_state_dict.base_optimizer_state");
    }
    if (base->is(Value::Kind::kList)) {
      return Status::Unsupported(BaseName(paths[d]) +
                                 " was saved with elastic_checkpoint; reshard reads the default "
                                 "(non-elastic) ZeRO format only");
    }
    if (mp == 0 && d == 0) {
      RESHARD_RETURN_IF_ERROR(DetectFormat(shard, stage.groups[0], paths[d]));
      RESHARD_RETURN_IF_ERROR(CheckFlatteningOrder(shard, BaseName(paths[d])));
    } else {
      RESHARD_RETURN_IF_ERROR(CheckSameScalars(stages_[0].shards[0], shard, BaseName(paths[d])));
    }
    for (int g = 0; g < num_groups_; ++g) {
      RESHARD_RETURN_IF_ERROR(AddFlats(shard, format_, states_, g, stage.groups[g], d,
                                       BaseName(paths[d]), &stage.flats, num_groups_));
      if (format_.slice_mappings) {
        RESHARD_RETURN_IF_ERROR(
            CheckSliceMappings(*OptimizerStateDict(shard), g, stage.groups[g], d, BaseName(paths[d])));
      }
    }
    stage.shards.push_back(std::move(shard));
  }
  return Status::Ok();
}

Status ShardOptimizer::LoadEmbeddedStage(const LogicalCheckpoint& src, int mp,
                                          const std::vector<int>& bounds) {
  Stage& stage = stages_[mp];
  const int p = mp / src.tp;
  std::vector<std::vector<ParamShape>> groups;
  if (!ReadParamShapes(src.metadata[mp], &groups)) {
    groups = StageParams(src, bounds[p], bounds[p + 1], src.tp, src.vocab.padded_rows).groups;
  }
  RESHARD_RETURN_IF_ERROR(CheckGroupCount(groups.size(), mp));
  for (const auto& g : groups) stage.groups.emplace_back(g, 1, format_.Alignment(1));
  const Value* optimizer = Find(src.metadata[mp], "optimizer");
  if (optimizer == nullptr || optimizer->is_none()) {
    return Status::InvalidInput(ModelStatesFileName(mp) + " has no optimizer state, but " +
                                ModelStatesFileName(0) + " has; the folder mixes checkpoints");
  }
  stage.shards.push_back(*optimizer);
  if (mp == 0) RESHARD_RETURN_IF_ERROR(DetectEmbeddedFormat(*optimizer, stage.groups[0]));
  return format_.per_parameter ? AddParamStates(mp, &stage) : AddEmbeddedFlats(mp, &stage);
}

Status ShardOptimizer::DetectEmbeddedFormat(const Value& optimizer, const FlatGroup& first_group) {
  if (Find(optimizer, "fp32_groups_flat") != nullptr && OptimizerStateDict(optimizer) != nullptr) {
    DetectStates(optimizer, first_group);
    return Status::Ok();
  }
  if (Find(optimizer, "state") != nullptr && ParamGroups(optimizer) != nullptr) {
    format_.per_parameter = true;
    DetectParamStates(optimizer, first_group);
    return Status::Ok();
  }
  return Status::Unsupported(
      ModelStatesFileName(0) + " holds an optimizer state that is neither FP16_Optimizer's "
      "(fp32_groups_flat) nor a torch optimizer state_dict (state, param_groups); reshard cannot "
      "reshape it (--weights-only converts the weights alone)");
}

void ShardOptimizer::DetectParamStates(const Value& optimizer, const FlatGroup& first_group) {
  const Value* first = TorchGroupState(&optimizer, 0);
  const Items* items = first != nullptr ? DictItems(*first) : nullptr;
  if (items == nullptr || first_group.slots().empty()) return;  // saved before the first step
  const std::vector<int64_t>& shape = first_group.slots()[0].shape;
  for (const auto& [k, v] : *items) {
    if (!k.is(Value::Kind::kString)) continue;  // refused when the parameter is read
    const bool per_element = v.is(Value::Kind::kTensor) && !shape.empty() && v.as_tensor().sizes == shape;
    (per_element ? states_ : scalar_states_).push_back(k.as_string());
  }
}

Status ShardOptimizer::AddEmbeddedFlats(int mp, Stage* stage) {
  for (int g = 0; g < num_groups_; ++g) {
    Status st = AddFlats(stage->shards[0], format_, states_, g, stage->groups[g], 0,
                         ModelStatesFileName(mp), &stage->flats, num_groups_);
    if (!st.ok()) {
      return Status::InvalidInput(st.message() +
                                  " (the groups follow DeepSpeed's current stage partition; a "
                                  "checkpoint partitioned otherwise cannot be read)");
    }
  }
  return Status::Ok();
}

Status ShardOptimizer::AddParamStates(int mp, Stage* stage) {
  const std::string file = ModelStatesFileName(mp);
  const Value& optimizer = stage->shards[0];
  const std::vector<Value>* groups = ParamGroups(optimizer);
  if (groups == nullptr || static_cast<int>(groups->size()) != num_groups_) {
    return NotThisStage(file, "its torch optimizer has " +
                                  std::to_string(groups != nullptr ? groups->size() : 0) +
                                  " parameter groups, the stage " + std::to_string(num_groups_));
  }
  const std::vector<Value>& first_groups = *ParamGroups(stages_[0].shards[0]);
  int64_t index = 0;
  for (int g = 0; g < num_groups_; ++g) {
    const std::vector<FlatSlot>& slots = stage->groups[g].slots();
    if (!HasIndices((*groups)[g], index, slots.size())) {
      return NotThisStage(file, "torch optimizer group " + std::to_string(g) +
                                    " does not list the stage's " + std::to_string(slots.size()) +
                                    " parameters " + std::to_string(index) + "-" +
                                    std::to_string(index + static_cast<int64_t>(slots.size()) - 1));
    }
    if (Hyperparameters((*groups)[g]) != Hyperparameters(first_groups[g])) {
      return Status::InvalidInput(file + ": torch optimizer group " + std::to_string(g) +
                                  " has other hyperparameters than " + ModelStatesFileName(0) +
                                  "'s; the folder mixes files of different saves");
    }
    for (size_t s = 0; s < slots.size(); ++s, ++index) {
      RESHARD_RETURN_IF_ERROR(AddParamState(TorchGroupState(&optimizer, static_cast<int>(index)),
                                            slots[s], g, static_cast<int>(s), index, file, stage));
    }
  }
  const Value* state_dict = Find(optimizer, "state");
  const Items* state = state_dict != nullptr ? DictItems(*state_dict) : nullptr;
  const size_t with_state = states_.empty() && scalar_states_.empty() ? 0 : static_cast<size_t>(index);
  if (state == nullptr || state->size() != with_state) {
    return NotThisStage(file, "its torch optimizer holds the state of " +
                                  std::to_string(state != nullptr ? state->size() : 0) +
                                  " parameters, the stage has " + std::to_string(index));
  }
  return Status::Ok();
}

Status ShardOptimizer::AddParamState(const Value* state, const FlatSlot& slot, int group,
                                      int slot_index, int64_t index, const std::string& file,
                                      Stage* stage) {
  const std::string which = "parameter " + slot.name + " (index " + std::to_string(index) + ")";
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  std::vector<std::string> all = states_;
  all.insert(all.end(), scalar_states_.begin(), scalar_states_.end());
  if (all.empty() && (items == nullptr || items->empty())) return Status::Ok();  // not stepped yet
  if (items == nullptr || items->size() != all.size()) {
    return Status::InvalidInput(file + ": the optimizer state of " + which +
                                " is not the first parameter's (" +
                                (all.empty() ? std::string("none") : Join(all, ", ")) +
                                "); reshard needs the same states for every parameter");
  }
  for (const std::string& name : states_) {
    const Tensor* t = ParamTensor(Find(*state, name), slot.shape);
    if (t == nullptr) {
      return Status::InvalidInput(file + ": optimizer state '" + name + "' of " + which +
                                  " is not a contiguous fp32 tensor of the parameter's shape " +
                                  ShapeString(slot.shape));
    }
    std::vector<std::vector<const Tensor*>>& by_group = stage->tensors[name];
    by_group.resize(num_groups_);
    by_group[group].resize(slot_index + 1);
    by_group[group][slot_index] = t;
  }
  for (const std::string& name : scalar_states_) {
    const Value* v = Find(*state, name);
    const Value* want = Find(*TorchGroupState(&stages_[0].shards[0], 0), name);
    if (v == nullptr || ScalarBytes(*v) != ScalarBytes(*want)) {
      return Status::InvalidInput(
          file + ": optimizer state '" + name + "' of " + which + " is " + ScalarText(v) + " but " +
          ScalarText(want) + " for the first parameter of " + ModelStatesFileName(0) +
          "; reshard reshapes states shaped like their parameter and carries the others (step), "
          "which must then agree across parameters and ranks");
    }
  }
  return Status::Ok();
}

std::vector<std::string> ShardOptimizer::ParamNames() const {
  std::vector<std::string> names;
  for (const auto& [name, p] : owner_) names.push_back(name);
  return names;
}

Result<SourceShard> ShardOptimizer::Locate(const std::string& name, int t,
                                            const std::string& state) const {
  auto owner = owner_.find(name);
  if (owner == owner_.end()) {
    return Status::InvalidInput("parameter " + name + " has no optimizer state in the source shards, so its "
                                "state cannot be written; pass --weights-only to convert the weights alone");
  }
  const Owner& o = owner->second;
  const Stage& stage = stages_[o.stage * tp_ + t];
  const FlatGroup& group = stage.groups[o.group];
  if (o.slot >= static_cast<int>(group.slots().size()) || group.slots()[o.slot].name != name) {
    return Status::InvalidInput("parameter " + name + " is missing from TP rank " +
                                std::to_string(t) + "'s optimizer shards");
  }
  // The per-parameter format keeps each state whole; the others in flats.
  const auto& by_state = format_.per_parameter ? stage.tensors : stage.flats;
  auto flats = by_state.find(state);
  if (flats == by_state.end()) return Status::Internal("no optimizer state '" + state + "'");
  if (format_.per_parameter) return SourceShard::Of(*flats->second[o.group][o.slot], ShardCoords{t, o.stage});
  const FlatSlot& slot = group.slots()[o.slot];
  const int64_t partition = group.partition();
  SourceShard shard;
  shard.at = ShardCoords{t, o.stage, static_cast<int>(slot.offset / partition)};
  for (int64_t done = 0; done < slot.numel;) {
    const int64_t flat_index = slot.offset + done;
    const int d = static_cast<int>(flat_index / partition);
    const int64_t in_partition = flat_index - d * partition;
    const int64_t n = std::min(slot.numel - done, partition - in_partition);
    const Tensor& flat = *flats->second[o.group][d];
    const ByteView& file = flat.storage->bytes;
    shard.runs.push_back({done, n, ByteView{file.owner, TensorData(flat) + in_partition * 4,
                                            static_cast<size_t>(n) * 4, file.mapped}});
    done += n;
  }
  return shard;
}

}  // namespace reshard
