#include "formats/deepspeed/moe_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "formats/deepspeed/file_names.h"
#include "formats/deepspeed/pipeline_reader.h"
#include "formats/deepspeed/torch_state.h"
#include "formats/deepspeed/zero_shard_writer.h"
#include "formats/file_jobs.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Where each parameter is in the logical checkpoint, by saved name.
using TensorIndex = std::map<std::string, std::pair<int, int>>;

TensorIndex IndexTensors(const LogicalCheckpoint& src) {
  TensorIndex index;
  for (size_t li = 0; li < src.layers.size(); ++li) {
    for (size_t ti = 0; ti < src.layers[li].tensors.size(); ++ti) {
      index[MoeSaveName(src.layers[li], src.layers[li].tensors[ti])] = {static_cast<int>(li), static_cast<int>(ti)};
    }
  }
  return index;
}

// What the planning of one (mp rank, target EP rank) needs.
struct EpRankTarget {
  const LogicalCheckpoint& src;
  const MoeOptimizer& opt;
  const TensorIndex& index;
  std::map<int, int> experts;  // layer id -> global experts
  int mp = 0, ep = 1, dp = 1, source_ep = 1;
  TensorTarget tensors;
};

// Expert `t` of `layer` in the order of an EP rank's expert groups (layer,
// expert, parameter): its global id and its name with local id `local`.
std::string ExpertName(const LogicalLayer& layer, const LogicalTensor& t, int local) {
  LogicalTensor renamed = t;
  renamed.key = t.rule->WithExpertId(t.key, local);
  return MoeSaveName(layer, renamed);
}

// The experts of EP rank `rank` (of `ep`) in group `group`, in the experts'
// order: (saved name, name on that rank).
std::vector<std::pair<std::string, std::string>> ExpertsOf(const EpRankTarget& x, int group, int rank, int ep) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const LogicalLayer& layer : x.src.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->expert == 0) continue;
      const int local_experts = x.experts.at(layer.id) / ep;
      const int id = t.rule->ExpertId(t.key);
      const std::string saved = MoeSaveName(layer, t);
      if (id / local_experts != rank || x.opt.GroupOf(saved, x.mp) != group) continue;
      out.push_back({saved, ExpertName(layer, t, id % local_experts)});
    }
  }
  return out;
}

// The source's expert groups list their experts in that order: the target's
// are laid out by it.
Status CheckExpertOrder(const EpRankTarget& x, int group) {
  for (int r = 0; r < x.source_ep; ++r) {
    std::vector<std::string> want;
    for (auto& [saved, local] : ExpertsOf(x, group, r, x.source_ep)) want.push_back(std::move(local));
    if (x.opt.GroupOrder(x.mp, group, r) == want) continue;
    return Status::Unsupported("expert group " + std::to_string(group) + " of EP rank " + std::to_string(r) + " on " +
                               ModelStatesName(x.mp) + " does not hold its experts in their order (layer, "
                               "expert, parameter); reshard cannot regroup it");
  }
  return Status::Ok();
}

Result<OptimizerStagePlan> PlanEpRank(const EpRankTarget& x, int rank) {
  OptimizerStagePlan plan;
  plan.pp_rank = x.mp / x.src.tp;
  plan.tp_rank = x.mp % x.src.tp;
  plan.ep = x.ep;
  plan.ep_rank = rank;
  for (int g = 0; g < x.opt.Groups(x.mp); ++g) {
    const bool expert = x.opt.IsExpertGroup(x.mp, g);
    std::vector<std::pair<std::string, std::string>> members;  // (saved, target name)
    if (expert) {
      RESHARD_RETURN_IF_ERROR(CheckExpertOrder(x, g));
      members = ExpertsOf(x, g, rank, x.ep);
    } else {
      for (const std::string& name : x.opt.GroupOrder(x.mp, g, -1)) members.push_back({name, name});
    }
    std::vector<ParamShape> shapes;
    std::vector<OptimizerSlotPlan> slots;
    for (const auto& [saved, name] : members) {
      auto at = x.index.find(saved);
      if (at == x.index.end()) {
        return Status::InvalidInput("the optimizer shards hold state for " + saved + ", which no tensor of the "
                                    "checkpoint is; the shards do not belong to this model");
      }
      const LogicalTensor& t = x.src.layers[at->second.first].tensors[at->second.second];
      shapes.push_back({name, t.local_shape});
      const TensorPlan tensor = PlanTensor(x.src, at->second.first, at->second.second, plan.tp_rank, x.tensors);
      slots.push_back({saved, t.local_shape, tensor, tensor});
    }
    const int over = expert ? x.dp / x.ep : x.dp;
    plan.groups.emplace_back(shapes, over, x.opt.format().Alignment(over));
    plan.slots.push_back(std::move(slots));
    plan.expert_group.push_back(expert);
  }
  return plan;
}

// DeepSpeed names an EP rank's groups after its EP group ("ep_size_2").
void RenameExpertGroups(const OptimizerStagePlan& plan, int source_ep, Value* shard) {
  Value* osd = FindMutable(*shard, "optimizer_state_dict");
  Value* base = osd ? FindMutable(*osd, "base_optimizer_state") : nullptr;
  Value* groups = base ? FindMutable(*base, "param_groups") : nullptr;
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
void RewriteExpertModules(const LogicalCheckpoint& src, const MoeLayout& layout, int mp, int ep, Value* module) {
  if (!module->is(Value::Kind::kObject) || module->as_object().state == nullptr) return;
  Value* meta = FindMutable(*module->as_object().state, "_metadata");
  Items* items = meta ? MutableDictItems(*meta) : nullptr;
  if (items == nullptr) return;
  for (const MoeBlock& b : layout.blocks) {
    if (b.stage != mp / src.tp) continue;
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

}  // namespace

Result<MoePlan> MakeMoePlan(const LogicalCheckpoint& src, const MoeLayout& layout, const MoeOptimizer* opt, int ep,
                            int dp, ReplicatedPolicy replicated) {
  MoePlan plan;
  plan.tp = src.tp;
  plan.pp = src.pp;
  plan.dp = dp;
  plan.ep = ep;
  plan.source_ep = layout.ep;
  const TensorIndex index = IndexTensors(src);
  for (int mp = 0; mp < src.tp * src.pp; ++mp) {
    MoeStagePlan stage;
    stage.mp = mp;
    if (opt != nullptr) {
      EpRankTarget x{src, *opt, index, {}, mp, ep, dp, layout.ep, TensorTarget{src.tp, src.vocab.padded_rows, replicated, 0}};
      for (const MoeBlock& b : layout.blocks) x.experts[b.layer_id] = b.experts;
      for (int r = 0; r < ep; ++r) {
        RESHARD_ASSIGN_OR_RETURN(OptimizerStagePlan o, PlanEpRank(x, r));
        stage.optimizer.push_back(std::move(o));
      }
    }
    plan.stages.push_back(std::move(stage));
  }
  if (ep != layout.ep) {
    plan.notes.push_back("MoE: experts regrouped from EP " + std::to_string(layout.ep) + " to EP " +
                         std::to_string(ep) + " (EP rank r holds experts r*E/" + std::to_string(ep) +
                         " to (r+1)*E/" + std::to_string(ep) + "-1 of every MoE layer, under local ids)");
  }
  return plan;
}

std::string MoePlan::ToString(bool detail) const {
  std::string out = "target: TP " + std::to_string(tp) + ", PP " + std::to_string(pp) + ", DP " +
                    std::to_string(dp) + ", EP " + std::to_string(ep) + " x expert-DP " + std::to_string(dp / ep) +
                    " (source EP " + std::to_string(source_ep) + ")\n";
  for (const MoeStagePlan& stage : stages) {
    out += "  " + ModelStatesFileName(stage.mp) + "  module and expert files kept, " + std::to_string(ep) +
           " expp_rank files, " + std::to_string(stage.optimizer.empty() ? 0 : dp) + " optimizer shards\n";
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
  for (const MoeStagePlan& stage : plan_.stages) RESHARD_RETURN_IF_ERROR(AddStageJobs(stage, read, &jobs));
  return jobs;
}

Status MoeTargetPlan::AddStageJobs(const MoeStagePlan& stage, std::atomic<int64_t>* read,
                                   std::vector<Job>* jobs) const {
  const int mp = stage.mp;
  Value states = src_.metadata[mp];
  Set(states, "dp_world_size", Value::Int(plan_.dp));
  Value* module = FindMutable(states, "module");
  if (Items* tensors = module ? MutableDictItems(*module) : nullptr) {
    for (auto& [key, tensor] : *tensors) tensor = WithOwnStorage(tensor);
    RewriteExpertModules(src_, layout_, mp, plan_.ep, module);
  }
  RESHARD_ASSIGN_OR_RETURN(Job model, TorchFileJob(ModelStatesFileName(mp), std::move(states)));
  jobs->push_back(std::move(model));
  if (auto experts = files_.expert_files.find(mp); experts != files_.expert_files.end()) {
    for (const auto& [m, by_expert] : experts->second) {
      for (const auto& [e, path] : by_expert) {
        RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(path, allowed_classes_));
        RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(ExpertFileName(m, e, mp), std::move(root)));
        jobs->push_back(std::move(job));
      }
    }
  }
  RESHARD_ASSIGN_OR_RETURN(Value expp, ReadDeepSpeedFile(files_.expert_optimizer_files.at(mp).begin()->second,
                                                         allowed_classes_));
  for (int r = 0; r < plan_.ep; ++r) {
    RESHARD_ASSIGN_OR_RETURN(Job job, TorchFileJob(ExpertOptimizerFileName(r, mp), expp));
    jobs->push_back(std::move(job));
  }
  for (const OptimizerStagePlan& o : stage.optimizer) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Value> shards,
                             BuildOptimizerState(*opt_, o, plan_.dp, read, &opt_->Shard(mp, 0)));
    for (size_t k = 0; k < shards.size(); ++k) {
      RenameExpertGroups(o, plan_.source_ep, &shards[k]);
      const int d = o.ep_rank + static_cast<int>(k) * o.ep;
      RESHARD_ASSIGN_OR_RETURN(
          Job job, TorchFileJob(OptimizerFileName(opt_->format().bf16_prefix, d, mp), std::move(shards[k])));
      jobs->push_back(std::move(job));
    }
  }
  return Status::Ok();
}

}  // namespace reshard
