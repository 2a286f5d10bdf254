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
#include "formats/deepspeed/files/torch_state.h"
#include "util/strings.h"

namespace reshard {

TensorIndex IndexTensors(const LogicalCheckpoint& src) {
  TensorIndex index;
  for (size_t li = 0; li < src.layers.size(); ++li) {
    for (size_t ti = 0; ti < src.layers[li].tensors.size(); ++ti) {
      index[MoeSaveName(src.layers[li], src.layers[li].tensors[ti])] = {static_cast<int>(li), static_cast<int>(ti)};
    }
  }
  return index;
}

const Value* ParamGroup(const MoeOptimizer& opt, int mp, int group) {
  const Value* base = MoeTorchState(opt.Shard(mp, 0), opt.format());
  const Value* groups = base != nullptr ? Find(*base, "param_groups") : nullptr;
  if (groups == nullptr || !groups->is(Value::Kind::kList)) return nullptr;
  const std::vector<Value>& items = groups->as_list().items;
  return group < static_cast<int>(items.size()) ? &items[group] : nullptr;
}

std::string ExpertName(const LogicalLayer& layer, const LogicalTensor& t, int local) {
  LogicalTensor renamed = t;
  renamed.key = t.rule->WithExpertId(t.key, local);
  return MoeSaveName(layer, renamed);
}

namespace {

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
                       int ep, MoeStagePlan* stage) {
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
      stage->expert_files.push_back(
          {ExpertFileName(layout.old_file_form ? -1 : target.index, e, stage->mp), path, e / (target.experts / ep)});
    }
  }
  return Status::Ok();
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
      RESHARD_RETURN_IF_ERROR(PlanExpertFiles(files, layout, src, st, target.ep, &stage));
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

std::string MoePlan::Summary() const {
  std::string out = "target: TP " + std::to_string(tp) + ", PP " + std::to_string(pp) + ", DP " +
                    std::to_string(dp) + ", EP " + std::to_string(ep) + " x expert-DP " + std::to_string(dp / ep) +
                    " (source EP " + std::to_string(source_ep) + ", PP " + std::to_string(source_pp) +
                    "); stage bounds (layer ids)";
  for (int b : stage_bounds) out += " " + std::to_string(b);
  return out + "\n";
}

std::string MoePlan::StageWhat(const MoeStagePlan& stage) const {
  std::set<int> from;
  for (const MoeModuleEntry& e : stage.module_entries) from.insert(e.mp);
  std::vector<std::string> sources;
  for (int mp : from) sources.push_back(ModelStatesName(mp));
  return "stage " + std::to_string(stage.pp_rank) + ", TP rank " + std::to_string(stage.tp_rank) + ": module of " +
         Count(static_cast<int64_t>(stage.module_entries.size()), "tensor") + " from " + Join(sources, ", ") + ", " +
         Count(static_cast<int64_t>(stage.blocks.size()), "MoE layer");
}

std::string MoePlan::ExppWhat(int ep_rank) const {
  return "EP rank " + std::to_string(ep_rank) +
         (state_in_expp ? ", holding its optimizer state" : shard_copies_in_expp ? ", a copy of its first shard's state" : "");
}

std::vector<std::string> MoePlan::OptimizerDetail(const OptimizerStagePlan& o) const {
  std::vector<std::string> out;
  for (size_t g = 0; g < o.groups.size(); ++g) {
    out.push_back("group " + std::to_string(g) + (o.expert_group[g] ? " (experts): " : ": ") +
                  Count(static_cast<int64_t>(o.groups[g].slots().size()), "parameter") + " over " +
                  Count(o.groups[g].dp(), "rank"));
    for (size_t s = 0; s < o.slots[g].size(); ++s) {
      out.push_back("  " + o.groups[g].slots()[s].name + " <- " + o.slots[g][s].source_param + " at " +
                    std::to_string(o.groups[g].slots()[s].offset));
    }
  }
  return out;
}

}  // namespace reshard
