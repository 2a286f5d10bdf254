#include "formats/deepspeed/moe/moe_optimizer.h"

#include <algorithm>
#include <tuple>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/model/stages.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/files/torch_state.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

const Value* Osd(const Value& shard) { return Find(shard, "optimizer_state_dict"); }

const Value* Item(const Value* list, int i) {
  if (list == nullptr || !list->is(Value::Kind::kList)) return nullptr;
  const std::vector<Value>& items = list->as_list().items;
  return i < static_cast<int>(items.size()) ? &items[i] : nullptr;
}

const Tensor* FlatFp32(const Value* v) {
  if (v == nullptr || !v->is(Value::Kind::kTensor)) return nullptr;
  const Tensor& t = v->as_tensor();
  const bool ok = t.storage != nullptr && t.storage->dtype == DType::kFloat32 && t.sizes.size() == 1 &&
                  t.IsContiguous() && t.storage_offset + t.numel() <= t.storage->numel;
  return ok ? &t : nullptr;
}

int64_t IntField(const Value& v, const char* name) {
  int64_t out = -1;
  if (const Value* f = Find(v, name)) ReadInt(*f, &out);
  return out;
}

bool IsMoeGroup(const Value& osd, int group) {
  const Value* base = Find(osd, "base_optimizer_state");
  const Value* g = base ? Item(Find(*base, "param_groups"), group) : nullptr;
  const Value* moe = g ? Find(*g, "moe") : nullptr;
  return moe != nullptr && moe->is(Value::Kind::kBool) && moe->as_bool();
}

// Experts of `layer`: the distinct ids its expert tensors carry.
int ExpertsOf(const LogicalLayer& layer) {
  std::set<int> ids;
  for (const LogicalTensor& t : layer.tensors) {
    if (t.rule->expert > 0) ids.insert(t.rule->ExpertId(t.key));
  }
  return static_cast<int>(ids.size());
}

std::string SaveName(const std::string& label, const std::string& key) {
  return label.empty() ? key : label + "." + key;
}

}  // namespace

std::string MoeSaveName(const LogicalLayer& layer, const LogicalTensor& t) { return SaveName(layer.label, t.key); }

const Value* MoeTorchState(const Value& shard, const OptimizerFormat& format) {
  if (format.per_parameter) return &shard;
  const Value* osd = Osd(shard);
  return osd != nullptr ? Find(*osd, "base_optimizer_state") : nullptr;
}

Value* MutableMoeTorchState(Value* shard, const OptimizerFormat& format) {
  return const_cast<Value*>(MoeTorchState(*shard, format));
}

Result<bool> ExppHoldsState(const CheckpointFiles& files, const std::set<std::string>& allowed_classes) {
  auto first = files.expert_optimizer_files.find(0);
  if (first == files.expert_optimizer_files.end() || first->second.empty()) return false;
  RESHARD_ASSIGN_OR_RETURN(Value expp, ReadDeepSpeedFile(first->second.begin()->second, allowed_classes));
  const Value* state = Find(expp, "optimizer");
  return state != nullptr && !state->is_none();
}

Result<std::unique_ptr<MoeOptimizer>> MoeOptimizer::Load(const LogicalCheckpoint& ckpt, const CheckpointFiles& files,
                                                         const MoeLayout& layout,
                                                         const std::set<std::string>& allowed_classes) {
  auto opt = std::unique_ptr<MoeOptimizer>(new MoeOptimizer());
  opt->tp_ = ckpt.tp;
  opt->ep_ = layout.ep;
  const int mp_ranks = ckpt.tp * ckpt.pp;
  std::vector<std::vector<const OptimizerShardFile*>> by_mp(mp_ranks);
  for (const OptimizerShardFile& f : files.optimizer_files) by_mp[f.mp_rank].push_back(&f);
  opt->shards_.resize(mp_ranks);
  for (int mp = 0; mp < mp_ranks; ++mp) {
    std::sort(by_mp[mp].begin(), by_mp[mp].end(),
              [](const OptimizerShardFile* a, const OptimizerShardFile* b) { return a->dp_rank < b->dp_rank; });
    RESHARD_RETURN_IF_ERROR(opt->LoadRank(mp, by_mp[mp], allowed_classes));
  }
  opt->format_.zero = Find(*Osd(opt->shards_[0][0]), "zero_stage") != nullptr;
  opt->format_.slice_mappings = true;
  opt->format_.bf16_prefix = files.optimizer_files.front().bf16;
  RESHARD_ASSIGN_OR_RETURN(opt->shard_copies_in_expp_, ExppHoldsState(files, allowed_classes));
  opt->DetectStates();
  opt->IndexNames(ckpt, layout);
  RESHARD_RETURN_IF_ERROR(opt->CheckCoverage(ckpt));
  return opt;
}

Result<std::unique_ptr<MoeOptimizer>> MoeOptimizer::LoadTorch(const LogicalCheckpoint& ckpt,
                                                              const CheckpointFiles& files, const MoeLayout& layout,
                                                              const std::vector<int>& stage_bounds,
                                                              const std::set<std::string>& allowed_classes) {
  auto opt = std::unique_ptr<MoeOptimizer>(new MoeOptimizer());
  opt->tp_ = ckpt.tp;
  opt->ep_ = layout.ep;
  opt->format_.embedded = opt->format_.per_parameter = true;
  opt->IndexNames(ckpt, layout);
  const int mp_ranks = ckpt.tp * ckpt.pp;
  opt->shards_.resize(mp_ranks);
  opt->moe_groups_.resize(mp_ranks);
  for (int mp = 0; mp < mp_ranks; ++mp) {
    for (int r = 0; r < layout.ep; ++r) {
      // The MoE reader has checked every expp_rank file is there.
      const std::string& path = files.expert_optimizer_files.at(mp).at(r);
      RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(path, allowed_classes));
      const Value* state = Find(root, "optimizer");
      if (state == nullptr || Find(*state, "state") == nullptr || ParamGroups(*state) == nullptr) {
        return Status::Unsupported(BaseName(path) + " holds no torch optimizer state_dict (state, param_groups) "
                                   "though the save has no ZeRO shards; reshard cannot read it (--weights-only "
                                   "converts the weights alone)");
      }
      opt->shards_[mp].push_back(*state);
      const int s = mp / ckpt.tp;
      RESHARD_RETURN_IF_ERROR(
          opt->IndexTorchRank(ckpt, mp, r, stage_bounds[s], stage_bounds[s + 1], BaseName(path)));
    }
  }
  opt->num_groups_ = static_cast<int>(ParamGroups(opt->shards_[0][0])->size());
  RESHARD_RETURN_IF_ERROR(opt->CheckCoverage(ckpt));
  return opt;
}

Status MoeOptimizer::IndexTorchRank(const LogicalCheckpoint& ckpt, int mp, int r, int lo, int hi,
                                    const std::string& file) {
  std::vector<ParamShape> params;
  std::set<std::string> experts;
  for (const LogicalLayer& layer : ckpt.layers) {
    if (layer.id < lo || layer.id >= hi) continue;
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->buffer) continue;
      const LocalName& local = where_.at(MoeSaveName(layer, t));
      if (local.ep >= 0 && local.ep != r) continue;
      params.push_back({local.name, t.local_shape});
      if (local.ep >= 0) experts.insert(local.name);
    }
  }
  // DeepSpeed splits the experts off each group into a `moe` group of its own, after all the others.
  std::vector<std::pair<bool, std::vector<ParamShape>>> groups;
  for (bool moe : {false, true}) {
    for (const std::vector<ParamShape>& base : GroupParams(params, ckpt.rules->optimizer_groups())) {
      std::vector<ParamShape> members;
      for (const ParamShape& p : base) {
        if ((experts.count(p.first) > 0) == moe) members.push_back(p);
      }
      if (!members.empty()) groups.push_back({moe, std::move(members)});
    }
  }
  const Value& state_dict = shards_[mp][r];
  const std::vector<Value>& saved = *ParamGroups(state_dict);
  if (saved.size() != groups.size()) {
    return Status::InvalidInput(file + " has " + std::to_string(saved.size()) + " optimizer groups, but DeepSpeed "
                                "groups the stage's parameters in " + std::to_string(groups.size()) + " (the rule "
                                "set's optimizer_groups, experts split off); reshard cannot tell whose state is whose");
  }
  if (mp == 0 && r == 0 && !groups.empty()) DetectTorchStates(state_dict, groups[0].second[0].second);
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> indices, want;
    const Value* listed = Find(saved[g], "params");
    const Value* moe = Find(saved[g], "moe");
    const bool is_moe = moe != nullptr && moe->is(Value::Kind::kBool) && moe->as_bool();
    for (size_t k = 0; k < groups[g].second.size(); ++k) want.push_back(index + static_cast<int64_t>(k));
    if (listed == nullptr || !ReadIntSequence(*listed, &indices) || indices != want || is_moe != groups[g].first) {
      return Status::InvalidInput(file + ": optimizer group " + std::to_string(g) + " does not list the " +
                                  std::to_string(want.size()) + (groups[g].first ? " expert" : " non-expert") +
                                  " parameters DeepSpeed puts there (indices " + std::to_string(index) + "-" +
                                  std::to_string(index + static_cast<int64_t>(want.size()) - 1) +
                                  "); reshard cannot tell whose state is whose");
    }
    if (r == 0) moe_groups_[mp].push_back(is_moe);
    for (const ParamShape& p : groups[g].second) {
      RESHARD_RETURN_IF_ERROR(AddTorchParam(state_dict, p, index, file));
      // Non-expert states are alike on every EP rank: EP rank 0's are read, the others checked against them.
      if (groups[g].first || r == 0) {
        places_[{mp, p.first, groups[g].first ? r : -1}] = Place{static_cast<int>(g), {}, index};
      } else {
        RESHARD_RETURN_IF_ERROR(CheckSameAsEpRankZero(mp, r, p, index, file));
      }
      ++index;
    }
  }
  return Status::Ok();
}

namespace {

// Both fp32 of one shape (ParamTensor has checked).
bool SameBytes(const Tensor& a, const Tensor& b) {
  return SameElements(SourceShard::Of(a, {}), SourceShard::Of(b, {}), a.numel(), sizeof(float));
}

}  // namespace

// Every EP rank steps the non-expert parameters with the same all-reduced
// gradients, so their states agree bit for bit; copies that differ would
// make reading EP rank 0's a guess.
Status MoeOptimizer::CheckSameAsEpRankZero(int mp, int r, const ParamShape& param, int64_t index,
                                           const std::string& file) const {
  const Value* mine = TorchGroupState(&shards_[mp][r], static_cast<int>(index));
  const Value* first = TorchGroupState(&shards_[mp][0], static_cast<int>(places_.at({mp, param.first, -1}).index));
  for (const std::string& name : states_) {
    const Tensor* a = ParamTensor(Find(*mine, name), param.second);
    const Tensor* b = ParamTensor(Find(*first, name), param.second);
    if (a == nullptr || b == nullptr || !SameBytes(*a, *b)) {
      return Status::InvalidInput(file + ": optimizer state '" + name + "' of the non-expert parameter " + param.first +
                                  " differs from EP rank 0's; DeepSpeed keeps these copies equal, so the file is "
                                  "damaged or was edited, and reshard will not pick one");
    }
  }
  return Status::Ok();
}

void MoeOptimizer::DetectTorchStates(const Value& state_dict, const std::vector<int64_t>& first_shape) {
  const Value* first = TorchGroupState(&state_dict, 0);
  const Items* items = first != nullptr ? DictItems(*first) : nullptr;
  if (items == nullptr) return;  // saved before the first step
  for (const auto& [k, v] : *items) {
    if (!k.is(Value::Kind::kString)) continue;  // refused when the parameter is read
    const bool per_element = v.is(Value::Kind::kTensor) && v.as_tensor().sizes == first_shape;
    (per_element ? states_ : scalar_states_).push_back(k.as_string());
  }
}

Status MoeOptimizer::AddTorchParam(const Value& state_dict, const ParamShape& param, int64_t index,
                                   const std::string& file) {
  const std::string which = "parameter " + param.first + " (index " + std::to_string(index) + ")";
  const Value* state = TorchGroupState(&state_dict, static_cast<int>(index));
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  const size_t want = states_.size() + scalar_states_.size();
  if (want == 0 && (items == nullptr || items->empty())) return Status::Ok();  // not stepped yet
  if (items == nullptr || items->size() != want) {
    return Status::InvalidInput(file + ": the optimizer state of " + which + " is not the first parameter's (" +
                                Join(states_, ", ") + "); reshard needs the same states for every parameter");
  }
  for (const std::string& name : states_) {
    if (ParamTensor(Find(*state, name), param.second) == nullptr) {
      return Status::InvalidInput(file + ": optimizer state '" + name + "' of " + which + " is not a contiguous "
                                  "fp32 tensor of the parameter's shape " + ShapeString(param.second) +
                                  "; the groups are not DeepSpeed's for this model");
    }
  }
  const Value* first = TorchGroupState(&shards_[0][0], 0);
  for (const std::string& name : scalar_states_) {
    const Value* v = Find(*state, name);
    const Value* want_value = Find(*first, name);
    if (v == nullptr || ScalarBytes(*v) != ScalarBytes(*want_value)) {
      return Status::InvalidInput(file + ": optimizer state '" + name + "' of " + which + " is " + ScalarText(v) +
                                  " but " + ScalarText(want_value) + " for the first parameter; reshard carries "
                                  "scalar states (step), which must agree across parameters and ranks");
    }
  }
  return Status::Ok();
}

void MoeOptimizer::IndexNames(const LogicalCheckpoint& ckpt, const MoeLayout& layout) {
  for (const LogicalLayer& layer : ckpt.layers) {
    const int local_experts = std::max(1, ExpertsOf(layer) / layout.ep);
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->buffer) continue;
      const std::string name = MoeSaveName(layer, t);
      LocalName& local = where_[name];
      local.name = name;
      if (t.rule->expert > 0) {
        const int id = t.rule->ExpertId(t.key);
        local.name = SaveName(layer.label, t.rule->WithExpertId(t.key, id % local_experts));
        local.ep = id / local_experts;
      }
      names_.push_back(name);
    }
  }
}

Status MoeOptimizer::LoadRank(int mp, const std::vector<const OptimizerShardFile*>& shards,
                              const std::set<std::string>& allowed_classes) {
  for (const OptimizerShardFile* f : shards) {
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(f->path, allowed_classes));
    const Value* osd = Osd(root);
    if (osd == nullptr || Find(*osd, "param_slice_mappings") == nullptr) {
      return Status::Unsupported(BaseName(f->path) + " has no optimizer_state_dict with param_slice_mappings; "
                                 "reshard places a MoE save's optimizer fragments by them (DeepSpeed >= 0.7)");
    }
    shards_[mp].push_back(std::move(root));
  }
  std::vector<int64_t> counts;
  ReadIntSequence(*Find(*Osd(shards_[mp][0]), "partition_count"), &counts);
  if (mp == 0) num_groups_ = static_cast<int>(counts.size());
  moe_groups_.resize(shards_.size());
  for (int g = 0; g < static_cast<int>(counts.size()); ++g) {
    moe_groups_[mp].push_back(IsMoeGroup(*Osd(shards_[mp][0]), g));
    RESHARD_RETURN_IF_ERROR(IndexGroup(mp, g, moe_groups_[mp][g], shards));
  }
  return Status::Ok();
}

Status MoeOptimizer::IndexGroup(int mp, int group, bool moe, const std::vector<const OptimizerShardFile*>& shards) {
  // Ascending DP ranks visit an EP rank's expert-DP partitions in order too.
  for (size_t d = 0; d < shards_[mp].size(); ++d) {
    const Value* mapping = Item(Find(*Osd(shards_[mp][d]), "param_slice_mappings"), group);
    const Items* fragments = mapping ? DictItems(*mapping) : nullptr;
    if (fragments == nullptr) {
      return Status::InvalidInput(BaseName(shards[d]->path) + " has no param_slice_mappings for group " +
                                  std::to_string(group) + ", which DP rank 0's shard has; the folder mixes saves");
    }
    const int ep = moe ? static_cast<int>(d) % ep_ : -1;
    for (const auto& [name, address] : *fragments) {
      if (!name.is(Value::Kind::kString)) continue;
      Place& place = places_[{mp, name.as_string(), ep}];
      place.group = group;
      place.fragments.push_back({static_cast<int>(d), IntField(address, "start"), IntField(address, "numel")});
    }
  }
  return Status::Ok();
}

void MoeOptimizer::DetectStates() {
  // The per-element states are as long as the partition: the fp32 master
  // without its padding, plus the padding.
  states_ = {kMasterState};
  const Value& osd = *Osd(shards_[0][0]);
  const Value* state = TorchGroupState(Find(osd, "base_optimizer_state"), 0);
  const Tensor* master = FlatFp32(Item(Find(osd, "single_partition_of_fp32_groups"), 0));
  std::vector<int64_t> paddings;
  if (const Value* p = Find(osd, format_.padding_key)) ReadIntSequence(*p, &paddings);
  if (state == nullptr || DictItems(*state) == nullptr || master == nullptr) return;
  const int64_t partition = master->numel() + (format_.zero && !paddings.empty() ? paddings[0] : 0);
  for (const auto& [k, v] : *DictItems(*state)) {
    const Tensor* t = FlatFp32(&v);
    if (k.is(Value::Kind::kString) && t != nullptr && t->numel() == partition) states_.push_back(k.as_string());
  }
}

const Tensor* MoeOptimizer::Partition(int mp, int d, int group, const std::string& state) const {
  const Value& osd = *Osd(shards_[mp][d]);
  if (state == kMasterState) return FlatFp32(Item(Find(osd, "single_partition_of_fp32_groups"), group));
  const Value* s = TorchGroupState(Find(osd, "base_optimizer_state"), group);
  return s ? FlatFp32(Find(*s, state)) : nullptr;
}

std::vector<std::string> MoeOptimizer::ParamNames() const { return names_; }

std::vector<std::string> MoeOptimizer::GroupOrder(int mp, int group, int ep) const {
  // Fragments of ascending ranks and starts are in flat order; torch states in index order.
  std::vector<std::pair<std::pair<int, int64_t>, std::string>> firsts;
  for (const auto& [key, place] : places_) {
    const auto& [m, name, rank] = key;
    if (m != mp || rank != ep || place.group != group) continue;
    firsts.push_back({place.fragments.empty() ? std::make_pair(0, place.index)
                                              : std::make_pair(place.fragments.front().dp, place.fragments.front().start),
                      name});
  }
  std::sort(firsts.begin(), firsts.end());
  std::vector<std::string> names;
  for (auto& [at, name] : firsts) names.push_back(std::move(name));
  return names;
}

int MoeOptimizer::GroupOf(const std::string& name, int mp) const {
  const auto [local, ep] = LocalNameOf(name);
  auto place = places_.find({mp, local, ep});
  return place == places_.end() ? -1 : place->second.group;
}

std::pair<std::string, int> MoeOptimizer::LocalNameOf(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? std::make_pair(name, -1) : std::make_pair(it->second.name, it->second.ep);
}

Result<SourceShard> MoeOptimizer::Locate(const std::string& name, int t, const std::string& state) const {
  auto local = where_.find(name);
  const int stages = static_cast<int>(shards_.size()) / tp_;
  for (int p = 0; local != where_.end() && p < stages; ++p) {
    const int mp = p * tp_ + t;
    auto place = places_.find({mp, local->second.name, local->second.ep});
    if (place == places_.end()) continue;
    if (format_.per_parameter) return TorchStateOf(mp, local->second.ep, place->second, t, state);
    SourceShard shard;
    shard.at = ShardCoords{t, p, place->second.fragments.front().dp, std::max(0, local->second.ep)};
    int64_t done = 0;
    for (const Fragment& f : place->second.fragments) {
      const Tensor* partition = Partition(mp, f.dp, place->second.group, state);
      if (partition == nullptr || f.start < 0 || f.numel < 0 || f.start + f.numel > partition->numel()) {
        return Status::InvalidInput(name + ": the '" + state + "' fragment of DP rank " + std::to_string(f.dp) +
                                    " on " + ModelStatesName(mp) + " lies outside its partition");
      }
      const ByteView& file = partition->storage->bytes;
      shard.runs.push_back({done, f.numel, ByteView{file.owner, TensorData(*partition) + f.start * 4,
                                                    static_cast<size_t>(f.numel) * 4, file.mapped}});
      done += f.numel;
    }
    return shard;
  }
  return Status::InvalidInput("parameter " + name + " has no optimizer state in the shards of TP rank " +
                              std::to_string(t) + (local == where_.end() || local->second.ep < 0 ? "" :
                              " (looked up as " + local->second.name + " of EP rank " +
                              std::to_string(local->second.ep) + ")"));
}

Result<SourceShard> MoeOptimizer::TorchStateOf(int mp, int ep, const Place& place, int t,
                                               const std::string& state) const {
  const Value* param = TorchGroupState(&shards_[mp][std::max(0, ep)], static_cast<int>(place.index));
  const Value* v = param != nullptr ? Find(*param, state) : nullptr;
  if (v == nullptr || !v->is(Value::Kind::kTensor)) return Status::Internal("no optimizer state '" + state + "'");
  return SourceShard::Of(v->as_tensor(), ShardCoords{t, mp / tp_, 0, std::max(0, ep)});
}

Status MoeOptimizer::CheckCoverage(const LogicalCheckpoint& ckpt) const {
  if (states_.empty()) return Status::Ok();  // saved before the first step
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->buffer) continue;
      int64_t numel = 1;
      for (int64_t d : t.local_shape) numel *= d;
      for (int r = 0; r < tp_; ++r) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, Locate(MoeSaveName(layer, t), r, states_[0]));
        if (shard.numel() == numel) continue;
        return Status::InvalidInput("the optimizer fragments of " + MoeSaveName(layer, t) + " hold " +
                                    std::to_string(shard.numel()) + " elements, but the tensor has " +
                                    std::to_string(numel) + "; the shards do not belong to this model");
      }
    }
  }
  return Status::Ok();
}

}  // namespace reshard
