#include "optim/source_optimizer.h"

#include <algorithm>
#include <cstring>

#include "format/torch_file.h"
#include "plan/stages.h"

namespace reshard {
namespace {

std::string FileName(const std::string& path) { return path.substr(path.rfind('/') + 1); }

const Value* OptimizerStateDict(const Value& shard) { return Find(shard, "optimizer_state_dict"); }

// base_optimizer_state["state"][group] (a dict keyed by the group index).
const Value* GroupState(const Value& osd, int group) {
  const Value* base = Find(osd, "base_optimizer_state");
  const Value* state = base != nullptr ? Find(*base, "state") : nullptr;
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  if (items == nullptr) return nullptr;
  for (const auto& [k, v] : *items) {
    int64_t g;
    if (ReadInt(k, &g) && g == group) return &v;
  }
  return nullptr;
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

const Tensor* MasterFlat(const Value& osd, int group) {
  const Value* list = Find(osd, "single_partition_of_fp32_groups");
  if (list == nullptr || !list->is(Value::Kind::kList)) return nullptr;
  const auto& items = list->as_list().items;
  return group < static_cast<int>(items.size()) ? FlatTensor(&items[group]) : nullptr;
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

}  // namespace

Result<std::unique_ptr<SourceOptimizer>> SourceOptimizer::Load(
    const LogicalCheckpoint& src, const std::set<std::string>& allowed_classes) {
  auto opt = std::unique_ptr<SourceOptimizer>(new SourceOptimizer());
  opt->tp_ = src.tp;
  std::vector<std::vector<std::string>> paths(src.metadata.size());
  for (const OptimizerFileName& f : src.files.optimizer_files) {
    auto& by_dp = paths[f.mp_rank];
    if (static_cast<int>(by_dp.size()) <= f.dp_rank) by_dp.resize(f.dp_rank + 1);
    by_dp[f.dp_rank] = f.path;
  }
  opt->stages_.resize(src.metadata.size());
  for (size_t mp = 0; mp < src.metadata.size(); ++mp) {
    RESHARD_RETURN_IF_ERROR(opt->LoadStage(src, static_cast<int>(mp), paths[mp], allowed_classes));
  }
  // Owners: the first pipeline stage holding a name (TP rank 0's view).
  for (int p = src.pp - 1; p >= 0; --p) {
    for (const FlatGroup& g : opt->stages_[p * src.tp].groups) {
      for (const FlatSlot& s : g.slots()) opt->owner_[s.name] = p;
    }
  }
  return opt;
}

Status SourceOptimizer::DetectFormat(const Value& shard, const FlatGroup& first_group,
                                     const std::string& path) {
  const Value& osd = *OptimizerStateDict(shard);
  format_.zero = Find(osd, "zero_stage") != nullptr;
  format_.slice_mappings = Find(osd, "param_slice_mappings") != nullptr;
  format_.bf16_prefix = FileName(path).rfind("bf16_", 0) == 0;
  if (Find(osd, "group_paddings") != nullptr) {
    format_.padding_key = "group_paddings";
  } else if (Find(osd, "groups_padding") != nullptr) {
    format_.padding_key = "groups_padding";
  } else {
    return Status::Unsupported(FileName(path) + " has no group_paddings; reshard does not know this optimizer format");
  }
  states_ = {kMasterState};
  const Value* state = GroupState(osd, 0);
  if (state != nullptr && DictItems(*state) != nullptr) {
    for (const auto& [k, v] : *DictItems(*state)) {
      const Tensor* t = FlatTensor(&v);
      if (k.is(Value::Kind::kString) && t != nullptr && t->numel() == first_group.partition()) {
        states_.push_back(k.as_string());
      }
    }
  }
  return Status::Ok();
}

Status SourceOptimizer::LoadStage(const LogicalCheckpoint& src, int mp,
                                  const std::vector<std::string>& paths,
                                  const std::set<std::string>& allowed_classes) {
  Stage& stage = stages_[mp];
  std::vector<std::vector<ParamShape>> groups;
  if (!ReadParamShapes(src.metadata[mp], &groups)) {
    return Status::Unsupported(ModelStatesFileName(mp) +
                               " records no param_shapes, so its optimizer shards cannot be read");
  }
  const int dp = static_cast<int>(paths.size());
  for (const auto& g : groups) stage.groups.emplace_back(g, dp);
  PickleReadOptions read;
  read.allowed_globals = allowed_classes;
  for (int d = 0; d < dp; ++d) {
    RESHARD_ASSIGN_OR_RETURN(Value shard, ReadTorchFile(paths[d], read));
    const Value* osd = OptimizerStateDict(shard);
    const Value* base = osd != nullptr ? Find(*osd, "base_optimizer_state") : nullptr;
    if (base == nullptr) {
      return Status::InvalidInput(paths[d] + " has no optimizer_state_dict.base_optimizer_state");
    }
    if (base->is(Value::Kind::kList)) {
      return Status::Unsupported(FileName(paths[d]) +
                                 " was saved with elastic_checkpoint; reshard reads the default "
                                 "(non-elastic) ZeRO format only");
    }
    if (mp == 0 && d == 0) {
      if (groups.empty()) return Status::InvalidInput(ModelStatesFileName(0) + " records no parameter groups");
      RESHARD_RETURN_IF_ERROR(DetectFormat(shard, stage.groups[0], paths[d]));
      num_groups_ = static_cast<int>(groups.size());
    }
    stage.shards.push_back(std::move(shard));
  }
  if (static_cast<int>(groups.size()) != num_groups_) {
    return Status::Unsupported(ModelStatesFileName(mp) + " has " + std::to_string(groups.size()) +
                               " parameter groups but " + ModelStatesFileName(0) + " has " +
                               std::to_string(num_groups_) + "; reshard needs the same groups on every stage");
  }
  for (int d = 0; d < dp; ++d) {
    const Value& osd = *OptimizerStateDict(stage.shards[d]);
    const std::string file = FileName(paths[d]);
    for (int g = 0; g < num_groups_; ++g) {
      const FlatGroup& layout = stage.groups[g];
      const int64_t want_master = format_.zero ? layout.partition() - layout.PaddingIn(d) : layout.partition();
      const Tensor* master = MasterFlat(osd, g);
      if (master == nullptr || master->numel() != want_master) {
        return Status::InvalidInput(file + ": the fp32 partition of group " + std::to_string(g) +
                                    " is not the " + std::to_string(want_master) +
                                    " elements that param_shapes and DP " + std::to_string(dp) + " give");
      }
      stage.flats[kMasterState].resize(num_groups_);
      stage.flats[kMasterState][g].push_back(master);
      for (size_t s = 1; s < states_.size(); ++s) {
        const Value* group_state = GroupState(osd, g);
        const Tensor* flat = FlatTensor(group_state != nullptr ? Find(*group_state, states_[s]) : nullptr);
        if (flat == nullptr || flat->numel() != layout.partition()) {
          return Status::InvalidInput(file + ": optimizer state '" + states_[s] + "' of group " +
                                      std::to_string(g) + " is missing or not " +
                                      std::to_string(layout.partition()) + " fp32 elements");
        }
        stage.flats[states_[s]].resize(num_groups_);
        stage.flats[states_[s]][g].push_back(flat);
      }
      if (format_.slice_mappings) RESHARD_RETURN_IF_ERROR(CheckSliceMappings(osd, g, layout, d, file));
    }
  }
  return Status::Ok();
}

std::vector<std::string> SourceOptimizer::ParamNames() const {
  std::vector<std::string> names;
  for (const auto& [name, p] : owner_) names.push_back(name);
  return names;
}

Result<std::vector<uint8_t>> SourceOptimizer::Gather(const std::string& name, int t,
                                                     const std::string& state) const {
  auto owner = owner_.find(name);
  if (owner == owner_.end()) {
    return Status::InvalidInput("parameter " + name + " has no optimizer state in the source shards");
  }
  const Stage& stage = stages_[owner->second * tp_ + t];
  auto flats = stage.flats.find(state);
  for (size_t g = 0; g < stage.groups.size(); ++g) {
    const FlatSlot* slot = stage.groups[g].Find(name);
    if (slot == nullptr) continue;
    const int64_t partition = stage.groups[g].partition();
    std::vector<uint8_t> out(static_cast<size_t>(slot->numel) * 4);
    for (int64_t done = 0; done < slot->numel;) {
      const int64_t flat_index = slot->offset + done;
      const int d = static_cast<int>(flat_index / partition);
      const int64_t in_partition = flat_index - d * partition;
      const int64_t n = std::min(slot->numel - done, partition - in_partition);
      std::memcpy(out.data() + done * 4, TensorData(*flats->second[g][d]) + in_partition * 4, n * 4);
      done += n;
    }
    return out;
  }
  return Status::InvalidInput("parameter " + name + " is missing from TP rank " + std::to_string(t) +
                              "'s optimizer shards");
}

}  // namespace reshard
