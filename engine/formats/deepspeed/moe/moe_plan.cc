#include "formats/deepspeed/moe/moe_plan.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/files/torch_state.h"
#include "formats/deepspeed/pipeline/zero_shard_writer.h"
#include "formats/file_jobs.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Where each parameter is in the logical checkpoint, by saved name.
TensorIndex IndexTensors(const LogicalCheckpoint& src) {
  TensorIndex index;
  for (size_t li = 0; li < src.layers.size(); ++li) {
    for (size_t ti = 0; ti < src.layers[li].tensors.size(); ++ti) {
      index[MoeSaveName(src.layers[li], src.layers[li].tensors[ti])] = {static_cast<int>(li), static_cast<int>(ti)};
    }
  }
  return index;
}

// The layers (ids) [lo, hi) of one target stage.
struct LayerRange {
  int lo = 0, hi = 0;
  bool Has(int id) const { return lo <= id && id < hi; }
};
constexpr LayerRange kAllLayers{std::numeric_limits<int>::min(), std::numeric_limits<int>::max()};

// Every source group's kind (GroupKind), by mp rank and group.
using GroupKinds = std::vector<std::vector<std::string>>;

// What the planning of one target stage's optimizer needs.
struct StageTarget {
  const LogicalCheckpoint& src;
  const MoeOptimizer& opt;
  const TensorIndex& index;
  const GroupKinds& kinds;
  std::map<int, int> experts;  // layer id -> global experts
  int tp_rank = 0, ep = 1, dp = 1, source_ep = 1;
  TensorTarget tensors;
  int source_tp_rank = 0;  // whose groups name the members (alike on every TP rank)
};

// Expert `t` of `layer` in the order of an EP rank's expert groups (layer,
// expert, parameter): its global id and its name with local id `local`.
std::string ExpertName(const LogicalLayer& layer, const LogicalTensor& t, int local) {
  LogicalTensor renamed = t;
  renamed.key = t.rule->WithExpertId(t.key, local);
  return MoeSaveName(layer, renamed);
}

// The experts of EP rank `rank` (of `ep`) in group `group` of mp rank `mp`,
// on the layers `range`, in the experts' order: (saved name, name on that rank).
std::vector<std::pair<std::string, std::string>> ExpertsOf(const StageTarget& x, int mp, int group, int rank, int ep,
                                                           LayerRange range) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const LogicalLayer& layer : x.src.layers) {
    if (!range.Has(layer.id)) continue;
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->expert == 0) continue;
      const int local_experts = x.experts.at(layer.id) / ep;
      const int id = t.rule->ExpertId(t.key);
      const std::string saved = MoeSaveName(layer, t);
      if (id / local_experts != rank || x.opt.GroupOf(saved, mp) != group) continue;
      out.push_back({saved, ExpertName(layer, t, id % local_experts)});
    }
  }
  return out;
}

// The source's expert groups list their experts in that order: the target's
// are laid out by it.
Status CheckExpertOrder(const StageTarget& x, int mp, int group) {
  for (int r = 0; r < x.source_ep; ++r) {
    std::vector<std::string> want;
    for (auto& [saved, local] : ExpertsOf(x, mp, group, r, x.source_ep, kAllLayers)) want.push_back(std::move(local));
    if (x.opt.GroupOrder(mp, group, r) == want) continue;
    return Status::Unsupported("expert group " + std::to_string(group) + " of EP rank " + std::to_string(r) + " on " +
                               ModelStatesName(mp) + " does not hold its experts in their order (layer, "
                               "expert, parameter); reshard cannot regroup it");
  }
  return Status::Ok();
}

const Value* ParamGroup(const MoeOptimizer& opt, int mp, int group) {
  const Value* base = MoeTorchState(opt.Shard(mp, 0), opt.format());
  const Value* groups = base != nullptr ? Find(*base, "param_groups") : nullptr;
  if (groups == nullptr || !groups->is(Value::Kind::kList)) return nullptr;
  const std::vector<Value>& items = groups->as_list().items;
  return group < static_cast<int>(items.size()) ? &items[group] : nullptr;
}

// A group's kind: whether it holds experts, and its hyperparameters (all
// but `params`). A target stage's group of a kind gathers the parameters the
// source stages had in their group of that kind.
std::string GroupKind(const MoeOptimizer& opt, int mp, int group) {
  const Value* hyper = ParamGroup(opt, mp, group);
  return std::string(opt.IsExpertGroup(mp, group) ? "experts; " : "dense; ") +
         (hyper != nullptr ? Hyperparameters(*hyper) : "");
}

GroupKinds AllGroupKinds(const LogicalCheckpoint& src, const MoeOptimizer& opt) {
  GroupKinds kinds(src.tp * src.pp);
  for (int mp = 0; mp < src.tp * src.pp; ++mp) {
    for (int g = 0; g < opt.Groups(mp); ++g) kinds[mp].push_back(GroupKind(opt, mp, g));
  }
  return kinds;
}

// The kinds of TP rank `t`'s groups over all source stages, in one order
// that keeps each stage's (DeepSpeed's: the weight-decay split, non-expert
// groups before expert ones); no stage may have two groups of one kind.
Result<std::vector<std::string>> KindOrder(const LogicalCheckpoint& src, const GroupKinds& kinds, int t) {
  std::vector<std::string> order;
  for (int s = 0; s < src.pp; ++s) {
    const int mp = s * src.tp + t;
    size_t at = 0;
    std::set<std::string> seen;
    for (const std::string& kind : kinds[mp]) {
      if (!seen.insert(kind).second) {
        return Status::Unsupported("two optimizer groups of " + ModelStatesName(mp) + " have the same "
                                   "hyperparameters; reshard cannot tell which one a parameter moved from "
                                   "another stage joins (keep --pp " + std::to_string(src.pp) + ")");
      }
      auto it = std::find(order.begin(), order.end(), kind);
      if (it == order.end()) it = order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), kind);
      at = static_cast<size_t>(it - order.begin()) + 1;
    }
  }
  return order;
}

// The members of the target group of kind `kind` on EP rank `rank`:
// (saved name, target name), from every source stage's group of that kind,
// on the layers `range`; `source` is set to the first group giving any.
Result<std::vector<std::pair<std::string, std::string>>> Members(const StageTarget& x, const std::string& kind,
                                                                 int rank, LayerRange range, MoeGroupSource* source) {
  std::vector<std::pair<std::string, std::string>> out;
  for (int s = 0; s < x.src.pp; ++s) {
    const int mp = s * x.src.tp + x.source_tp_rank;
    for (int g = 0; g < x.opt.Groups(mp); ++g) {
      if (x.kinds[mp][g] != kind) continue;
      const size_t before = out.size();
      if (x.opt.IsExpertGroup(mp, g)) {
        RESHARD_RETURN_IF_ERROR(CheckExpertOrder(x, mp, g));
        for (auto& member : ExpertsOf(x, mp, g, rank, x.ep, range)) out.push_back(std::move(member));
      } else {
        for (const std::string& name : x.opt.GroupOrder(mp, g, -1)) {
          auto at = x.index.find(name);
          if (at == x.index.end()) {
            return Status::InvalidInput("the optimizer shards hold state for " + name + ", which no tensor of the "
                                        "checkpoint is; the shards do not belong to this model");
          }
          if (range.Has(x.src.layers[at->second.first].id)) out.push_back({name, name});
        }
      }
      if (before == 0 && !out.empty()) *source = {mp, g};
    }
  }
  return out;
}

// EP rank `rank`'s optimizer on target stage `pp_rank` (the layers `range`):
// a group per kind that has members there; `sources` gets where each came from.
Result<OptimizerStagePlan> PlanEpRank(const StageTarget& x, const std::vector<std::string>& kinds, int pp_rank,
                                      LayerRange range, int rank, std::vector<MoeGroupSource>* sources) {
  OptimizerStagePlan plan;
  plan.pp_rank = pp_rank;
  plan.tp_rank = x.tp_rank;
  plan.ep = x.ep;
  plan.ep_rank = rank;
  sources->clear();
  for (const std::string& kind : kinds) {
    MoeGroupSource source;
    RESHARD_ASSIGN_OR_RETURN(auto members, Members(x, kind, rank, range, &source));
    if (members.empty()) continue;  // DeepSpeed keeps no empty groups
    const bool expert = x.opt.IsExpertGroup(source.mp, source.group);
    std::vector<ParamShape> shapes;
    std::vector<OptimizerSlotPlan> slots;
    for (const auto& [saved, name] : members) {
      auto at = x.index.find(saved);
      const TensorPlan tensor = PlanTensor(x.src, at->second.first, at->second.second, plan.tp_rank, x.tensors);
      shapes.push_back({name, tensor.shape});
      slots.push_back({saved, tensor, tensor});
    }
    // Without ZeRO nothing is partitioned.
    const int over = x.opt.format().per_parameter ? 1 : expert ? x.dp / x.ep : x.dp;
    plan.groups.emplace_back(shapes, over, x.opt.format().Alignment(over));
    plan.slots.push_back(std::move(slots));
    plan.expert_group.push_back(expert);
    sources->push_back(source);
  }
  return plan;
}

// DeepSpeed names an EP rank's groups after its EP group ("ep_size_2").
void RenameExpertGroups(const OptimizerStagePlan& plan, int source_ep, Value* torch_state) {
  Value* groups = torch_state ? FindMutable(*torch_state, "param_groups") : nullptr;
  if (groups == nullptr || !groups->is(Value::Kind::kList)) return;
  for (size_t g = 0; g < plan.expert_group.size() && g < groups->as_list().items.size(); ++g) {
    Value& group = groups->as_list().items[g];
    const Value* name = Find(group, "name");
    if (plan.expert_group[g] && name != nullptr && name->is(Value::Kind::kString) &&
        name->as_string() == "ep_size_" + std::to_string(source_ep)) {
      Set(group, "name", Value::String("ep_size_" + std::to_string(plan.ep)));
    }
  }
}

// The modules of EP rank 0's experts of MoE layer `layer` at `local`
// experts per EP rank, as state_dict()._metadata lists them: every module on
// the way to an expert parameter below the experts' container, in order.
std::vector<std::string> ExpertModules(const LogicalLayer& layer, int local, std::string* container) {
  std::vector<std::string> paths;
  std::set<std::string> seen;
  for (int k = 0; k < local; ++k) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->expert == 0 || t.rule->ExpertId(t.key) != 0) continue;  // expert 0's parameters stand for all
      const std::string name = ExpertName(layer, t, k);
      const size_t id = MoeSaveName(layer, t).size() - t.key.size() + t.rule->ExpertIdOffset(t.key);
      *container = name.substr(0, id - 1);
      for (size_t dot = name.find('.', id); dot != std::string::npos; dot = name.find('.', dot + 1)) {
        if (seen.insert(name.substr(0, dot)).second) paths.push_back(name.substr(0, dot));
      }
    }
  }
  return paths;
}

// The module's `_metadata` (its BUILD state) lists the modules of EP rank
// 0's local experts: the target EP rank 0 has other ones.
void RewriteExpertModules(const LogicalCheckpoint& src, const std::vector<MoeBlock>& blocks, int ep, Items* items) {
  for (const MoeBlock& b : blocks) {
    const LogicalLayer& layer = *std::find_if(src.layers.begin(), src.layers.end(),
                                              [&](const LogicalLayer& l) { return l.id == b.layer_id; });
    std::string container;
    const std::vector<std::string> paths = ExpertModules(layer, b.experts / ep, &container);
    Items out;
    for (auto& [key, value] : *items) {
      const std::string path = key.is(Value::Kind::kString) ? key.as_string() : "";
      if (path.rfind(container + ".", 0) == 0) continue;  // the source's experts
      out.emplace_back(key, value);
      if (path != container) continue;
      for (const std::string& p : paths) out.emplace_back(Value::String(p), value);
    }
    *items = std::move(out);
  }
}

// The spec a module path of a pipeline module's `_metadata` (state_dict()'s
// list of modules) is in: its first component; none for the root,
// tied_modules and module paths of the engine without pipelining.
std::optional<int> SpecOfModulePath(const Value& key) {
  if (!key.is(Value::Kind::kString)) return std::nullopt;
  const std::string& path = key.as_string();
  const std::string first = path.substr(0, path.find('.'));
  if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(first);
}

// The `_metadata` of an mp_rank file's module (null when it has none).
const Items* SavedModules(const Value& states) {
  const Value* module = Find(states, "module");
  if (module == nullptr || !module->is(Value::Kind::kObject) || module->as_object().state == nullptr) return nullptr;
  const Value* meta = Find(*module->as_object().state, "_metadata");
  return meta != nullptr ? DictItems(*meta) : nullptr;
}

Items* ModuleMetadata(Value* module) {
  if (!module->is(Value::Kind::kObject) || module->as_object().state == nullptr) return nullptr;
  Value* meta = FindMutable(*module->as_object().state, "_metadata");
  return meta != nullptr ? MutableDictItems(*meta) : nullptr;
}

// The target stage's MoE layers, numbered as the target stage numbers them.
std::vector<MoeBlock> StageBlocks(const MoeLayout& layout, int pp_rank, LayerRange range) {
  std::vector<MoeBlock> out;
  for (MoeBlock b : layout.blocks) {
    if (!range.Has(b.layer_id)) continue;
    b.stage = pp_rank;
    b.index = static_cast<int>(out.size());
    out.push_back(b);
  }
  return out;
}

// The source expert files of the stage's MoE layers under their target names.
Status PlanExpertFiles(const CheckpointFiles& files, const MoeLayout& layout, const LogicalCheckpoint& src, int t,
                       MoeStagePlan* stage) {
  for (const MoeBlock& target : stage->blocks) {
    const MoeBlock& source = *std::find_if(layout.blocks.begin(), layout.blocks.end(),
                                           [&](const MoeBlock& b) { return b.layer_id == target.layer_id; });
    const int m = layout.old_file_form ? -1 : source.index;
    const int source_mp = source.stage * src.tp + t;
    auto by_layer = files.expert_files.find(source_mp);
    if (by_layer == files.expert_files.end() || by_layer->second.count(m) == 0) {
      return Status::InvalidInput(files.tag_dir + " has no expert files of MoE layer " + std::to_string(m) + " on " +
                                  ModelStatesName(source_mp) + "; the folder is incomplete");
    }
    for (const auto& [e, path] : by_layer->second.at(m)) {
      stage->expert_files.push_back({ExpertFileName(layout.old_file_form ? -1 : target.index, e, stage->mp), path});
    }
  }
  return Status::Ok();
}

// The target stage's module `_metadata`: the source's entries outside the
// specs (the root, tied_modules), then every source stage's entries of the
// stage's specs, in order.
Items StageModules(const LogicalCheckpoint& src, const MoeStagePlan& stage, LayerRange range) {
  Items out;
  const int t = stage.source_mp % src.tp;
  if (const Items* items = SavedModules(src.metadata[stage.source_mp])) {
    for (const auto& entry : *items) {
      if (!SpecOfModulePath(entry.first)) out.push_back(entry);
    }
  }
  for (int s = 0; s < src.pp; ++s) {
    const Items* items = SavedModules(src.metadata[s * src.tp + t]);
    for (size_t i = 0; items != nullptr && i < items->size(); ++i) {
      const std::optional<int> spec = SpecOfModulePath((*items)[i].first);
      if (spec && range.Has(*spec)) out.push_back((*items)[i]);
    }
  }
  return out;
}

// The module tensors of the target stage: every source stage's tensors of
// the layers `range`, in order, as (source mp rank, key).
Status PlanModule(const LogicalCheckpoint& src, const TensorIndex& index, int t, LayerRange range,
                  MoeStagePlan* stage) {
  for (int s = 0; s < src.pp; ++s) {
    const int mp = s * src.tp + t;
    const Value* module = Find(src.metadata[mp], "module");
    const Items* items = module != nullptr ? DictItems(*module) : nullptr;
    for (size_t i = 0; items != nullptr && i < items->size(); ++i) {
      const Value& key = (*items)[i].first;
      auto at = key.is(Value::Kind::kString) ? index.find(key.as_string()) : index.end();
      if (at == index.end()) {
        return Status::InvalidInput(ModelStatesName(mp) + "'s module holds " + key.DebugString() + ", which no rule "
                                    "describes; reshard cannot tell which stage it belongs to");
      }
      if (range.Has(src.layers[at->second.first].id)) {
        stage->module_entries.push_back({mp, key.as_string(), at->second.first, at->second.second});
      }
    }
  }
  return Status::Ok();
}

// A shard to build the stage's shards from: the source's first shard with
// the param_groups and per-group torch states of the groups' sources (the
// layout fields are replaced by BuildOptimizerState). Without ZeRO the
// states are per parameter: the first stands for all (BuildOptimizerState
// numbers them anew).
Value StageTemplate(const MoeOptimizer& opt, const MoeStagePlan& stage) {
  Value like = opt.Shard(stage.group_sources.empty() ? stage.source_mp : stage.group_sources[0].mp, 0);
  Value* base = MutableMoeTorchState(&like, opt.format());
  std::vector<Value> groups;
  Items states;
  for (size_t g = 0; g < stage.group_sources.size(); ++g) {
    const MoeGroupSource& source = stage.group_sources[g];
    Value group = *ParamGroup(opt, source.mp, source.group);
    Set(group, "params", Value::MakeList({Value::Int(static_cast<int64_t>(g))}));
    groups.push_back(std::move(group));
    const int slot = opt.format().per_parameter ? 0 : source.group;
    if (const Value* state = TorchGroupState(MoeTorchState(opt.Shard(source.mp, 0), opt.format()), slot)) {
      states.emplace_back(Value::Int(static_cast<int64_t>(g)), *state);
    }
  }
  Set(*base, "state", Value::MakeDict(std::move(states)));
  Set(*base, "param_groups", Value::MakeList(std::move(groups)));
  return like;
}

// True when `version` ("0.14.5", "0.16.5+8e0d3ab") is a release before
// major.minor.patch; false when it does not read as one.
bool VersionBefore(const std::string& version, const std::vector<int64_t>& than) {
  std::vector<int64_t> parts;
  size_t at = 0;
  while (parts.size() < than.size()) {
    const size_t end = version.find_first_not_of("0123456789", at);
    int64_t n = 0;
    if (!ParseInt(version.substr(at, end - at), &n)) return false;
    parts.push_back(n);
    if (parts.size() < than.size() && (end == std::string::npos || version[end] != '.')) return false;
    at = end + 1;
  }
  return parts < than;
}

// DeepSpeed before 0.15.4 averaged ZeRO-1/2 expert gradients over the
// expert-DP group instead of all of DP (its PR 6546), so their scale
// depends on EP: a note when the EP change meets the saved moments with
// gradients of another scale.
std::optional<std::string> ExpertGradientScaleNote(const MoeOptimizer& opt, int source_ep, int target_ep) {
  const Value* version = Find(opt.Template(), "ds_version");
  if (opt.format().per_parameter || version == nullptr || !version->is(Value::Kind::kString) ||
      !VersionBefore(version->as_string(), {0, 15, 4})) {
    return std::nullopt;
  }
  char ratio[32];
  std::snprintf(ratio, sizeof(ratio), "%gx", static_cast<double>(target_ep) / source_ep);
  return "MoE: this save's DeepSpeed " + version->as_string() + " averages ZeRO expert gradients over "
         "expert-DP only (fixed in DeepSpeed 0.15.4): resumed at EP " + std::to_string(target_ep) +
         " by such a version, expert gradients are " + ratio + " those the saved Adam moments saw, and "
         "training departs from an uninterrupted run; the moments are carried as saved";
}

}  // namespace

Result<std::vector<int>> SourceStageBounds(const LogicalCheckpoint& src) {
  const TensorIndex index = IndexTensors(src);
  std::vector<int> bounds;
  for (int s = 0; s < src.pp; ++s) {
    int lo = std::numeric_limits<int>::max();
    const Value* module = Find(src.metadata[s * src.tp], "module");
    const Items* items = module != nullptr ? DictItems(*module) : nullptr;
    for (size_t i = 0; items != nullptr && i < items->size(); ++i) {
      const Value& key = (*items)[i].first;
      auto at = key.is(Value::Kind::kString) ? index.find(key.as_string()) : index.end();
      if (at != index.end()) lo = std::min(lo, src.layers[at->second.first].id);
    }
    if (lo == std::numeric_limits<int>::max()) {
      return Status::InvalidInput(ModelStatesName(s * src.tp) + "'s module holds no tensor the rules describe; "
                                  "reshard cannot tell which layers its stage holds");
    }
    bounds.push_back(s == 0 ? std::min(lo, src.layers.front().id) : lo);
  }
  bounds.push_back(src.layers.back().id + 1);
  return bounds;
}

Result<MoePlan> MakeMoePlan(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeLayout& layout,
                            const MoeOptimizer* opt, const MoeTarget& target) {
  MoePlan plan;
  plan.tp = target.tp;
  plan.source_tp = src.tp;
  plan.tensors = TensorTarget{target.tp, target.padded_vocab, target.replicated, 0};
  plan.pp = static_cast<int>(target.stage_bounds.size()) - 1;
  plan.dp = target.dp;
  plan.ep = target.ep;
  plan.source_pp = src.pp;
  plan.source_ep = layout.ep;
  plan.stage_bounds = target.stage_bounds;
  plan.state_in_expp = opt != nullptr && opt->format().per_parameter;
  plan.shard_copies_in_expp = opt != nullptr && opt->shard_copies_in_expp();
  const TensorIndex index = IndexTensors(src);
  const GroupKinds group_kinds = opt != nullptr ? AllGroupKinds(src, *opt) : GroupKinds();
  std::vector<std::vector<std::string>> kinds(src.tp);  // per TP rank, in order
  for (int t = 0; opt != nullptr && t < src.tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(kinds[t], KindOrder(src, group_kinds, t));
  }
  for (int p = 0; p < plan.pp; ++p) {
    const LayerRange range{plan.stage_bounds[p], plan.stage_bounds[p + 1]};
    for (int t = 0; t < plan.tp; ++t) {
      // The source TP rank whose module keys, expert files, groups and
      // metadata the target TP rank takes: alike on every TP rank.
      const int st = std::min(t, src.tp - 1);
      MoeStagePlan stage;
      stage.mp = p * plan.tp + t;
      stage.pp_rank = p;
      stage.tp_rank = t;
      stage.source_mp = (p < src.pp ? p : 0) * src.tp + st;
      stage.blocks = StageBlocks(layout, p, range);
      RESHARD_RETURN_IF_ERROR(PlanModule(src, index, st, range, &stage));
      RESHARD_RETURN_IF_ERROR(PlanExpertFiles(files, layout, src, st, &stage));
      if (opt != nullptr) {
        StageTarget x{src, *opt, index, group_kinds, {}, t, target.ep, target.dp, layout.ep, plan.tensors, st};
        for (const MoeBlock& b : layout.blocks) x.experts[b.layer_id] = b.experts;
        for (int r = 0; r < target.ep; ++r) {
          RESHARD_ASSIGN_OR_RETURN(OptimizerStagePlan o, PlanEpRank(x, kinds[st], p, range, r, &stage.group_sources));
          stage.optimizer.push_back(std::move(o));
        }
      }
      plan.stages.push_back(std::move(stage));
    }
  }
  if (target.ep != layout.ep) {
    plan.notes.push_back("MoE: experts regrouped from EP " + std::to_string(layout.ep) + " to EP " +
                         std::to_string(target.ep) + " (EP rank r holds experts r*E/" + std::to_string(target.ep) +
                         " to (r+1)*E/" + std::to_string(target.ep) + "-1 of every MoE layer, under local ids)");
    if (opt != nullptr) {
      if (std::optional<std::string> note = ExpertGradientScaleNote(*opt, layout.ep, target.ep)) {
        plan.notes.push_back(*note);
      }
    }
  }
  if (plan.tp != src.tp) {
    plan.notes.push_back("MoE: TP " + std::to_string(src.tp) + " -> " + std::to_string(plan.tp) +
                         ": the non-expert tensors cut by their rules, the experts whole on every TP rank");
    const std::string vocab = VocabPaddingNote(src.vocab.padded_rows, target.padded_vocab, plan.tp, 0);
    if (!vocab.empty()) plan.notes.push_back(vocab);
  }
  if (plan.pp != src.pp) {
    plan.notes.push_back("MoE: " + std::to_string(src.pp) + " pipeline stages re-cut into " + std::to_string(plan.pp) +
                         "; each stage numbers its MoE layers from 0 in the expert file names");
  }
  return plan;
}

std::string MoePlan::ToString(bool detail) const {
  std::string out = "target: TP " + std::to_string(tp) + ", PP " + std::to_string(pp) + ", DP " +
                    std::to_string(dp) + ", EP " + std::to_string(ep) + " x expert-DP " + std::to_string(dp / ep) +
                    " (source EP " + std::to_string(source_ep) + ", PP " + std::to_string(source_pp) +
                    "); stage bounds (layer ids)";
  for (int b : stage_bounds) out += " " + std::to_string(b);
  out += "\n";
  for (const MoeStagePlan& stage : stages) {
    std::set<int> from;
    for (const MoeModuleEntry& e : stage.module_entries) from.insert(e.mp);
    std::vector<std::string> sources;
    for (int mp : from) sources.push_back(ModelStatesName(mp));
    out += "  " + ModelStatesFileName(stage.mp) + "  stage " + std::to_string(stage.pp_rank) + ": module of " +
           std::to_string(stage.module_entries.size()) + " tensors from " + Join(sources, ", ") + ", " +
           std::to_string(stage.blocks.size()) + " MoE layers (" + std::to_string(stage.expert_files.size()) +
           " expert files), " + std::to_string(ep) + " expp_rank files" +
           (state_in_expp ? " holding the optimizer state"
                          : (shard_copies_in_expp ? " (copies of their EP rank's first shard), " : ", ") +
                                std::to_string(stage.optimizer.empty() ? 0 : dp) + " optimizer shards") +
           "\n";
    if (detail) {
      for (const MoeExpertFilePlan& f : stage.expert_files) out += "    " + f.name + " <- " + BaseName(f.source) + "\n";
    }
    for (const OptimizerStagePlan& o : stage.optimizer) {
      out += "    EP rank " + std::to_string(o.ep_rank) + ":";
      for (size_t g = 0; g < o.groups.size(); ++g) {
        out += " group " + std::to_string(g) + (o.expert_group[g] ? " (experts) " : " ") +
               std::to_string(o.groups[g].slots().size()) + " parameters over " + std::to_string(o.groups[g].dp()) +
               " ranks;";
      }
      out += "\n";
      if (!detail) continue;
      for (size_t g = 0; g < o.groups.size(); ++g) {
        for (size_t s = 0; s < o.slots[g].size(); ++s) {
          out += "      group " + std::to_string(g) + " " + o.groups[g].slots()[s].name + " <- " +
                 o.slots[g][s].source_param + " at " + std::to_string(o.groups[g].slots()[s].offset) + "\n";
        }
      }
    }
  }
  return out;
}

Result<std::vector<Job>> MoeTargetPlan::Jobs(std::atomic<int64_t>* read) const {
  std::vector<Job> jobs;
  const TensorIndex index = IndexTensors(src_);
  for (const MoeStagePlan& stage : plan_.stages) RESHARD_RETURN_IF_ERROR(AddStageJobs(stage, index, read, &jobs));
  return jobs;
}

Result<Value> MoeTargetPlan::CutTensor(const MoeStagePlan& stage, int layer, int tensor, const Value& like,
                                       std::atomic<int64_t>* read) const {
  const LogicalTensor& t = src_.layers[layer].tensors[tensor];
  const TensorPlan plan = PlanTensor(src_, layer, tensor, stage.tp_rank, plan_.tensors);
  RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(src_, opt_, t, plan, read));
  Value cut = MakeProducedTensor(src_.WeightDType(t), plan.shape, std::move(produce));
  if (like.is(Value::Kind::kTensor)) {
    cut.as_tensor().storage->location = like.as_tensor().storage->location;
    cut.as_tensor().requires_grad = like.as_tensor().requires_grad;
  }
  return cut;
}

Result<Value> MoeTargetPlan::ExpertFile(const MoeStagePlan& stage, const MoeExpertFilePlan& file,
                                        const TensorIndex& index, std::atomic<int64_t>* read) const {
  RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(file.source, allowed_classes_));
  Items* items = MutableDictItems(root);
  if (plan_.tp == plan_.source_tp || items == nullptr) return root;
  for (auto& [key, value] : *items) {
    auto at = key.is(Value::Kind::kString) ? index.find(key.as_string()) : index.end();
    if (at == index.end()) {
      return Status::InvalidInput(BaseName(file.source) + " holds " + key.DebugString() + ", which no rule describes");
    }
    RESHARD_ASSIGN_OR_RETURN(value, CutTensor(stage, at->second.first, at->second.second, value, read));
  }
  return root;
}

Result<Value> MoeTargetPlan::ModelStates(const MoeStagePlan& stage, std::atomic<int64_t>* read) const {
  Value states = src_.metadata[stage.source_mp];
  Set(states, "dp_world_size", Value::Int(plan_.dp));
  Set(states, "mp_world_size", Value::Int(plan_.tp * plan_.pp));
  std::vector<Value> experts;
  for (const MoeBlock& b : stage.blocks) experts.push_back(Value::Int(b.experts));
  Set(states, "num_experts", Value::MakeList(std::move(experts)));
  Value* module = FindMutable(states, "module");
  Items* tensors = module != nullptr ? MutableDictItems(*module) : nullptr;
  if (tensors == nullptr) {
    return Status::InvalidInput(ModelStatesName(stage.source_mp) + " has no module dict; it is not a MoE save");
  }
  Items out;
  for (const MoeModuleEntry& e : stage.module_entries) {
    const Value& saved = *Find(*Find(src_.metadata[e.mp], "module"), e.key);
    if (plan_.tp == plan_.source_tp) {
      out.emplace_back(Value::String(e.key), WithOwnStorage(saved));
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(Value cut, CutTensor(stage, e.layer, e.tensor, saved, read));
    out.emplace_back(Value::String(e.key), std::move(cut));
  }
  *tensors = std::move(out);
  if (Items* meta = ModuleMetadata(module)) {
    const LayerRange range{plan_.stage_bounds[stage.pp_rank], plan_.stage_bounds[stage.pp_rank + 1]};
    *meta = StageModules(src_, stage, range);
    RewriteExpertModules(src_, stage.blocks, plan_.ep, meta);
  }
  return states;
}

Status MoeTargetPlan::AddStageJobs(const MoeStagePlan& stage, const TensorIndex& index, std::atomic<int64_t>* read,
                                   std::vector<Job>* jobs) const {
  const int mp = stage.mp;
  RESHARD_ASSIGN_OR_RETURN(Value states, ModelStates(stage, read));
  RESHARD_ASSIGN_OR_RETURN(Job model, TorchFileJob(ModelStatesFileName(mp), std::move(states)));
  jobs->push_back(std::move(model));
  for (const MoeExpertFilePlan& f : stage.expert_files) {
    RESHARD_ASSIGN_OR_RETURN(Value root, ExpertFile(stage, f, index, read));
    RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(f.name, std::move(root)));
    jobs->push_back(std::move(job));
  }
  RESHARD_ASSIGN_OR_RETURN(Value expp, ReadDeepSpeedFile(files_.expert_optimizer_files.at(stage.source_mp).begin()->second,
                                                         allowed_classes_));
  Set(expp, "optimizer", Value::None());  // what ZeRO and weights-only targets hold
  std::vector<Value> expp_files(plan_.ep, expp);
  const Value like = stage.optimizer.empty() ? Value::None() : StageTemplate(*opt_, stage);
  for (const OptimizerStagePlan& o : stage.optimizer) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Value> shards, BuildOptimizerState(*opt_, o, plan_.dp, read, &like));
    for (size_t k = 0; k < shards.size(); ++k) {
      RenameExpertGroups(o, plan_.source_ep, MutableMoeTorchState(&shards[k], opt_->format()));
      if (opt_->format().per_parameter) {  // without ZeRO, the EP rank's whole torch state
        Set(expp_files[o.ep_rank], "optimizer", std::move(shards[k]));
        continue;
      }
      const int d = o.ep_rank + static_cast<int>(k) * o.ep;
      if (k == 0 && plan_.shard_copies_in_expp) {
        Set(expp_files[o.ep_rank], "optimizer", *Find(shards[k], "optimizer_state_dict"));
      }
      RESHARD_ASSIGN_OR_RETURN(
          Job job, TorchFileJob(OptimizerFileName(opt_->format().bf16_prefix, d, mp), std::move(shards[k])));
      jobs->push_back(std::move(job));
    }
  }
  for (int r = 0; r < plan_.ep; ++r) {
    RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(ExpertOptimizerFileName(r, mp), std::move(expp_files[r])));
    jobs->push_back(std::move(job));
  }
  return Status::Ok();
}

}  // namespace reshard
