#include "formats/deepspeed/moe/moe_writer.h"

#include <algorithm>
#include <optional>
#include <set>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/files/torch_state.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/pipeline/zero_shard_writer.h"
#include "util/strings.h"

namespace reshard {
namespace {

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

// What a file of `stage` is to the rank that loads it: DP rank `dp` (-1:
// every DP rank), EP rank `ep` (-1: every EP rank).
FileRole StageRole(const MoeStagePlan& stage, FileRole::Holds holds, int dp, std::string entry, int ep) {
  return FileRole{holds, stage.tp_rank, stage.pp_rank, dp, std::move(entry), "", ep};
}

// Plans the files of a MoePlan, stage by stage.
class MoeWriter {
 public:
  MoeWriter(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeOptimizer* opt,
            const std::set<std::string>& allowed_classes, const MoePlan& plan, std::atomic<int64_t>* read)
      : src_(src), files_(files), opt_(opt), allowed_classes_(allowed_classes), plan_(plan), read_(read),
        index_(IndexTensors(src)) {}

  Status AddStage(const MoeStagePlan& stage, std::vector<PlannedFile>* out) const;

 private:
  // The stage's mp_rank file: the source metadata with the stage's module.
  Result<Value> ModelStates(const MoeStagePlan& stage) const;
  // An expert file of the stage: the source's, its tensors cut for the
  // stage's TP rank when TP changes (whole experts are taken from TP rank 0's
  // or merged by the replicated policy; expert-TP ones cut by their rules).
  Result<Value> ExpertFile(const MoeStagePlan& stage, const MoeExpertFilePlan& file) const;
  // Tensor src.layers[layer].tensors[tensor] at the stage's TP rank, cut
  // from every source TP rank's, stored as `like` (its saved tensor) was.
  Result<Value> CutTensor(const MoeStagePlan& stage, int layer, int tensor, const Value& like) const;
  // Where the tensor `key` of a file made from the source file `source`
  // comes from, for --dry-run: as saved there, or cut as CutTensor cuts it.
  std::string TensorFrom(const MoeStagePlan& stage, const std::string& key, const std::string& source) const;
  // The optimizer shards of the stage and its expp_rank files.
  Status AddOptimizerFiles(const MoeStagePlan& stage, std::vector<PlannedFile>* out) const;

  const LogicalCheckpoint& src_;
  const CheckpointFiles& files_;
  const MoeOptimizer* opt_;
  const std::set<std::string>& allowed_classes_;
  const MoePlan& plan_;
  std::atomic<int64_t>* read_;
  const TensorIndex index_;
};

Result<Value> MoeWriter::CutTensor(const MoeStagePlan& stage, int layer, int tensor, const Value& like) const {
  const LogicalTensor& t = src_.layers[layer].tensors[tensor];
  const TensorPlan plan = PlanTensor(src_, layer, tensor, stage.tp_rank, plan_.tensors);
  RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(src_, opt_, t, plan, read_));
  Value cut = MakeProducedTensor(src_.WeightDType(t), plan.shape, std::move(produce));
  if (like.is(Value::Kind::kTensor)) {
    cut.as_tensor().storage->location = like.as_tensor().storage->location;
    cut.as_tensor().requires_grad = like.as_tensor().requires_grad;
  }
  return cut;
}

std::string MoeWriter::TensorFrom(const MoeStagePlan& stage, const std::string& key,
                                  const std::string& source) const {
  auto at = index_.find(key);
  if (plan_.tp == plan_.source_tp || at == index_.end()) return BaseName(source) + " " + key;
  const auto [layer, tensor] = at->second;
  const LogicalTensor& t = src_.layers[layer].tensors[tensor];
  return "(" + t.rule->Describe() + ") " + DescribeSources(PlanTensor(src_, layer, tensor, stage.tp_rank, plan_.tensors));
}

Result<Value> MoeWriter::ExpertFile(const MoeStagePlan& stage, const MoeExpertFilePlan& file) const {
  RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(file.source, allowed_classes_));
  Items* items = MutableDictItems(root);
  if (plan_.tp == plan_.source_tp || items == nullptr) return root;
  for (auto& [key, value] : *items) {
    auto at = key.is(Value::Kind::kString) ? index_.find(key.as_string()) : index_.end();
    if (at == index_.end()) {
      return Status::InvalidInput(BaseName(file.source) + " holds " + key.DebugString() + ", which no rule describes");
    }
    RESHARD_ASSIGN_OR_RETURN(value, CutTensor(stage, at->second.first, at->second.second, value));
  }
  return root;
}

Result<Value> MoeWriter::ModelStates(const MoeStagePlan& stage) const {
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
    RESHARD_ASSIGN_OR_RETURN(Value cut, CutTensor(stage, e.layer, e.tensor, saved));
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

Status MoeWriter::AddStage(const MoeStagePlan& stage, std::vector<PlannedFile>* out) const {
  RESHARD_ASSIGN_OR_RETURN(Value states, ModelStates(stage));
  RESHARD_ASSIGN_OR_RETURN(PlannedFile model, TorchFile(ModelStatesFileName(stage.mp), plan_.StageWhat(stage),
                                                        std::move(states)));
  model.roles.push_back(StageRole(stage, FileRole::Holds::kWeights, -1, "module", -1));
  for (const MoeModuleEntry& e : stage.module_entries) {
    SetFrom(&model, "module/" + e.key, TensorFrom(stage, e.key, ModelStatesName(e.mp)));
  }
  SetUnsaidFrom(&model, "", "as " + ModelStatesName(stage.source_mp) + " holds it");
  out->push_back(std::move(model));
  for (const MoeExpertFilePlan& f : stage.expert_files) {
    RESHARD_ASSIGN_OR_RETURN(Value root, ExpertFile(stage, f));
    RESHARD_ASSIGN_OR_RETURN(PlannedFile expert, TorchFile(f.name, "from " + BaseName(f.source), std::move(root)));
    expert.roles.push_back(StageRole(stage, FileRole::Holds::kWeights, -1, "", f.ep_rank));
    for (PlannedTensor& t : expert.tensors) t.from = TensorFrom(stage, t.key, f.source);
    out->push_back(std::move(expert));
  }
  return AddOptimizerFiles(stage, out);
}

Status MoeWriter::AddOptimizerFiles(const MoeStagePlan& stage, std::vector<PlannedFile>* out) const {
  const int mp = stage.mp;
  RESHARD_ASSIGN_OR_RETURN(Value expp, ReadDeepSpeedFile(files_.expert_optimizer_files.at(stage.source_mp).begin()->second,
                                                         allowed_classes_));
  Set(expp, "optimizer", Value::None());  // what ZeRO and weights-only targets hold
  std::vector<Value> expp_files(plan_.ep, expp);
  const Value like = stage.optimizer.empty() ? Value::None() : StageTemplate(*opt_, stage);
  for (const OptimizerStagePlan& o : stage.optimizer) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Value> shards, BuildOptimizerState(*opt_, o, plan_.dp, read_, &like));
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
          PlannedFile shard,
          TorchFile(OptimizerFileName(opt_->format().bf16_prefix, d, mp),
                    "optimizer of " + ModelStatesName(mp) + ", EP rank " + std::to_string(o.ep_rank) + ", DP rank " +
                        std::to_string(d),
                    std::move(shards[k])));
      shard.detail = plan_.OptimizerDetail(o);
      SetUnsaidFrom(&shard, "", kOptimizerStateFrom);
      shard.roles.push_back(StageRole(stage, FileRole::Holds::kOptimizer, d, "", o.ep_rank));
      out->push_back(std::move(shard));
    }
  }
  for (int r = 0; r < plan_.ep; ++r) {
    RESHARD_ASSIGN_OR_RETURN(PlannedFile file, TorchFile(ExpertOptimizerFileName(r, mp), plan_.ExppWhat(r),
                                                         std::move(expp_files[r])));
    if (plan_.state_in_expp) file.roles.push_back(StageRole(stage, FileRole::Holds::kOptimizer, -1, "optimizer", r));
    out->push_back(std::move(file));
  }
  return Status::Ok();
}

}  // namespace

Result<OutputPlan> MoeOutput(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeOptimizer* opt,
                             const std::set<std::string>& allowed_classes, const MoePlan& plan) {
  OutputPlan out;
  out.summary = plan.Summary();
  const MoeWriter writer(src, files, opt, allowed_classes, plan, out.read.get());
  for (const MoeStagePlan& stage : plan.stages) RESHARD_RETURN_IF_ERROR(writer.AddStage(stage, &out.files));
  return out;
}

}  // namespace reshard
