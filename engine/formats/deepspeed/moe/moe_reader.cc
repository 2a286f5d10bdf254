#include "formats/deepspeed/moe/moe_reader.h"

#include <re2/re2.h>

#include <algorithm>
#include <optional>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "logical/rule_selection.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// One tensor of an mp rank as saved: its full key, and the expert file it
// came from (none: the mp_rank file's module).
struct Entry {
  std::string key;
  Value tensor;
  std::optional<ExpertFileSlot> from;
};

// The entry placed in a layer: its spec id, label and key in the layer.
struct Placed {
  int id = 0;
  std::string label;
  std::string key;
};

std::string KeyString(const Value& k) { return k.is(Value::Kind::kString) ? k.as_string() : k.DebugString(); }

// A key held twice (two expert files of one expert, say) would make one copy
// silently win.
Status CheckKeysUnique(const std::vector<Entry>& entries, int mp) {
  std::map<std::string, const Entry*> seen;
  for (const Entry& e : entries) {
    auto [it, fresh] = seen.emplace(e.key, &e);
    if (fresh) continue;
    auto where = [mp](const Entry& x) {
      return x.from ? ExpertFileName(x.from->moe_layer, x.from->expert, mp) : ModelStatesFileName(mp);
    };
    return Status::InvalidInput(where(e) + " and " + where(*it->second) + " both hold " + e.key +
                                "; one of them does not belong to this checkpoint");
  }
  return Status::Ok();
}

// mp rank `mp`'s tensors: its module's, then its expert files'.
Result<std::vector<Entry>> RankEntries(const DeepSpeedModel& m, int mp, const std::set<std::string>& allowed) {
  std::vector<Entry> entries;
  const Value* module = Find(m.logical.metadata[mp], "module");
  if (module == nullptr || DictItems(*module) == nullptr) {
    return Status::InvalidInput(ModelStatesFileName(mp) + " has no `module` state dict; a DeepSpeed MoE save "
                                "keeps the model's non-expert tensors there");
  }
  for (const auto& [k, v] : *DictItems(*module)) entries.push_back({KeyString(k), v, std::nullopt});
  auto files = m.files.expert_files.find(mp);
  if (files == m.files.expert_files.end()) return entries;
  for (const auto& [layer, by_expert] : files->second) {
    for (const auto& [expert, path] : by_expert) {
      RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(path, allowed));
      if (DictItems(root) == nullptr) return Status::InvalidInput(path + " does not hold a state dict");
      for (const auto& [k, v] : *DictItems(root)) {
        entries.push_back({KeyString(k), v, ExpertFileSlot{layer, expert, mp}});
      }
    }
  }
  RESHARD_RETURN_IF_ERROR(CheckKeysUnique(entries, mp));
  return entries;
}

bool PipelineNames(const std::vector<Entry>& entries) {
  static const RE2 re(R"(\d+\..+)");
  for (const Entry& e : entries) {
    if (!RE2::FullMatch(e.key, re)) return false;
  }
  return true;
}

// `<spec>.<key>`: the pipeline engine's names.
Result<Placed> PlacePipelineName(const std::string& key, int mp) {
  static const RE2 re(R"((\d+)\.(.+))");
  Placed p;
  if (!RE2::FullMatch(key, re, &p.id, &p.key)) {
    return Status::InvalidInput(ModelStatesName(mp) + " mixes pipeline names (`<spec>.<key>`) with '" + key +
                                "'; the checkpoint mixes saves of two engines");
  }
  p.label = std::to_string(p.id);
  return p;
}

// The rule set that names every module path of `entries`: `spec`, or the
// one built-in set whose module_paths do.
Result<std::shared_ptr<const RuleSet>> ModuleRules(const std::string& spec, const std::vector<Entry>& entries) {
  auto explains = [&](const RuleSet& rules) {
    std::string role, key;
    int block = 0;
    return std::all_of(entries.begin(), entries.end(),
                       [&](const Entry& e) { return rules.SplitModulePath(e.key, &role, &block, &key); });
  };
  if (!spec.empty()) {
    RESHARD_ASSIGN_OR_RETURN(RuleSet rules, LoadRuleSet(spec));
    if (rules.module_paths().empty()) {
      return Status::RuleError("rule set '" + rules.name() + "' has no module_paths, so it cannot read a "
                               "non-pipeline (nn.Module) save; add them (docs/rules.md#module-paths)");
    }
    return std::make_shared<const RuleSet>(std::move(rules));
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> all, LoadBuiltinRuleSets());
  std::vector<std::shared_ptr<const RuleSet>> fits;
  for (RuleSet& rules : all) {
    if (!rules.module_paths().empty() && explains(rules)) fits.push_back(std::make_shared<const RuleSet>(std::move(rules)));
  }
  if (fits.size() == 1) return fits[0];
  if (fits.empty()) {
    return Status::RuleError("no built-in rule set's module_paths name every tensor of this non-pipeline save "
                             "(e.g. '" + entries.front().key + "'); write a rule file with module_paths "
                             "(docs/rules.md) and pass --rules FILE");
  }
  return Status::RuleError("several rule sets name this save's module paths; choose one with --rules NAME");
}

// Spec ids for module paths: the role's entry in the rule set's first spec
// list, the N-th block for block N.
class ModulePlacer {
 public:
  ModulePlacer(const RuleSet& rules, const std::vector<Entry>& entries) : rules_(rules) {
    int blocks = 0;
    for (const Entry& e : entries) {
      std::string role, key;
      int block = -1;
      if (rules.SplitModulePath(e.key, &role, &block, &key)) blocks = std::max(blocks, block + 1);
    }
    specs_ = ExpandSpecs(rules.numberings().begin()->second, blocks);
  }

  Result<Placed> Place(const std::string& path) const {
    std::string role;
    int block = -1;
    Placed p;
    rules_.SplitModulePath(path, &role, &block, &p.key);
    int nth = role == "block" ? block : 0;
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (specs_[i].role != role || nth-- > 0) continue;
      p.id = static_cast<int>(i);
      p.label = path.substr(0, path.size() - p.key.size());
      if (!p.label.empty() && p.label.back() == '.') p.label.pop_back();
      return p;
    }
    return Status::RuleError(rules_.origin() + ": module path '" + path + "' is a " + role +
                             ", which the spec list '" + rules_.numberings().begin()->first + "' does not have");
  }

 private:
  const RuleSet& rules_;
  std::vector<SpecEntry> specs_;
};

// The pipeline engine's TP size: the mp ranks of a stage hold the same
// specs, and stages hold disjoint, ascending ones.
Result<int> StageTp(const std::vector<std::set<int>>& ids) {
  int tp = 1;
  while (tp < static_cast<int>(ids.size()) && ids[tp] == ids[0]) ++tp;
  const int mp = static_cast<int>(ids.size());
  if (mp % tp != 0) {
    return Status::InvalidInput(std::to_string(mp) + " mp_rank files do not form stages of " + std::to_string(tp) +
                                " TP ranks (mp_rank_00 to " + ModelStatesName(tp - 1) +
                                " hold the same specs); the checkpoint is incomplete");
  }
  for (int r = 0; r < mp; ++r) {
    const int first = r - r % tp;
    if (ids[r] != ids[first] || ids[r].empty()) {
      return Status::InvalidInput(ModelStatesName(r) + " holds other specs than " + ModelStatesName(first) +
                                  ", the first TP rank of its stage; the checkpoint mixes saves");
    }
    if (r == first && r > 0 && *ids[r].begin() <= *ids[r - 1].rbegin()) {
      return Status::InvalidInput(ModelStatesName(r) + " starts at spec " + std::to_string(*ids[r].begin()) +
                                  ", not after the previous stage's last spec " + std::to_string(*ids[r - 1].rbegin()) +
                                  "; the checkpoint mixes saves");
    }
  }
  return tp;
}

// Where every entry of every mp rank goes: pipeline names or module paths.
Result<std::vector<std::vector<Placed>>> PlaceAll(const std::vector<std::vector<Entry>>& ranks, bool pipeline,
                                                  const RuleSet* rules) {
  std::optional<ModulePlacer> placer;
  if (!pipeline) placer.emplace(*rules, ranks[0]);
  std::vector<std::vector<Placed>> out(ranks.size());
  for (size_t mp = 0; mp < ranks.size(); ++mp) {
    for (const Entry& e : ranks[mp]) {
      Result<Placed> p = pipeline ? PlacePipelineName(e.key, static_cast<int>(mp)) : placer->Place(e.key);
      if (!p.ok()) return p.status();
      out[mp].push_back(std::move(*p));
    }
  }
  return out;
}

// The layers of a stage of `tp` ranks starting at mp rank `first`, as a
// pipeline checkpoint's layer files would hold them; notes where each
// expert tensor came from.
void BuildLayers(const std::vector<std::vector<Entry>>& ranks, const std::vector<std::vector<Placed>>& placed,
                 int stage, int tp, MoeModel* out, std::map<int, int>* stage_of_layer, ExpertOrigins* origins) {
  std::map<int, LogicalLayer> layers;
  std::map<int, std::vector<Items>> items;  // id -> TP rank -> entries
  for (int t = 0; t < tp; ++t) {
    const int mp = stage * tp + t;
    for (size_t i = 0; i < ranks[mp].size(); ++i) {
      const Placed& p = placed[mp][i];
      LogicalLayer& layer = layers[p.id];
      layer.id = p.id;
      layer.label = p.label;
      std::vector<Items>& per_rank = items[p.id];
      per_rank.resize(tp);
      per_rank[t].push_back({Value::String(p.key), ranks[mp][i].tensor});
      if (t == 0 && ranks[mp][i].from) (*origins)[{p.id, p.key}] = *ranks[mp][i].from;
    }
  }
  for (auto& [id, layer] : layers) {
    for (Items& rank_items : items[id]) layer.roots.push_back(MakeOrderedDict(std::move(rank_items)));
    (*stage_of_layer)[id] = stage;
    out->model->logical.layers.push_back(std::move(layer));
  }
}

// Degrees from the files must agree with what the metadata records.
Status CheckRecordedDegrees(const LogicalCheckpoint& ckpt) {
  const int64_t mp_world = MetadataInt(ckpt.metadata[0], "mp_world_size", -1);
  const int64_t files = static_cast<int64_t>(ckpt.metadata.size());
  if (mp_world >= 0 && mp_world != files) {
    return Status::InvalidInput("mp_world_size is " + std::to_string(mp_world) + " in the metadata but there are " +
                                std::to_string(files) + " mp_rank files; the folder is incomplete or mixes checkpoints");
  }
  const int64_t dp_world = MetadataInt(ckpt.metadata[0], "dp_world_size", -1);
  if (dp_world >= 0 && ckpt.dp > 0 && dp_world != ckpt.dp) {
    return Status::InvalidInput("dp_world_size is " + std::to_string(dp_world) + " in the metadata but the "
                                "optimizer shards show DP " + std::to_string(ckpt.dp) +
                                "; the folder is incomplete or mixes checkpoints");
  }
  return Status::Ok();
}

// A rule set that splits the experts over TP (expert-TP) read on a save
// whose TP ranks each hold whole experts would join identical copies into
// experts TP times too big. Refused when every TP rank's part of each split
// expert matrix of the first MoE layer equals TP rank 0's, as parts of
// trained (or randomly initialised) weights never do.
Status CheckExpertSplit(const LogicalCheckpoint& ckpt) {
  if (ckpt.tp < 2) return Status::Ok();
  for (const LogicalLayer& layer : ckpt.layers) {
    const LogicalTensor* split = nullptr;
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule == nullptr || t.rule->expert == 0 || t.rule->policy != ParamRule::Policy::kSplit ||
          t.local_shape.size() < 2) {
        continue;
      }
      for (int r = 1; r < ckpt.tp; ++r) {
        if (!SameElements(t.shards[0], t.shards[r], ShapeNumel(t.local_shape), ElementSize(t.dtype))) {
          return Status::Ok();
        }
      }
      split = &t;
    }
    if (split == nullptr) continue;
    return Status::InvalidInput("every TP rank's expert files hold the same " + split->key + " of layer " +
                                layer.label + ", which the rule set splits over TP (expert-TP): the save has "
                                "whole experts on every TP rank; use a rule set whose expert rules are replicated");
  }
  return Status::Ok();
}

}  // namespace

Result<MoeModel> ReadMoeModel(CheckpointFiles files, const CommonOptions& options) {
  const std::set<std::string>& allowed = options.allowed_classes;
  MoeModel out;
  out.model = std::make_unique<DeepSpeedModel>();
  DeepSpeedModel& m = *out.model;
  m.files = std::move(files);
  LogicalCheckpoint& ckpt = m.logical;
  int tp = 0, pp = 0;
  RESHARD_RETURN_IF_ERROR(CheckRankGrid(m.files, &tp, &pp, &ckpt.dp));
  RESHARD_RETURN_IF_ERROR(ReadMetadata(allowed, &m));
  std::vector<std::vector<Entry>> ranks;
  for (size_t mp = 0; mp < ckpt.metadata.size(); ++mp) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<Entry> entries, RankEntries(m, static_cast<int>(mp), allowed));
    ranks.push_back(std::move(entries));
  }
  out.pipeline_names = PipelineNames(ranks[0]);
  std::string rules = options.rules;
  std::shared_ptr<const RuleSet> module_rules;
  if (!out.pipeline_names) {
    RESHARD_ASSIGN_OR_RETURN(module_rules, ModuleRules(options.rules, ranks[0]));
    if (rules.empty()) rules = module_rules->name();
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::vector<Placed>> placed,
                           PlaceAll(ranks, out.pipeline_names, module_rules.get()));
  if (out.pipeline_names) {
    std::vector<std::set<int>> ids(placed.size());
    for (size_t mp = 0; mp < placed.size(); ++mp) {
      for (const Placed& p : placed[mp]) ids[mp].insert(p.id);
    }
    RESHARD_ASSIGN_OR_RETURN(ckpt.tp, StageTp(ids));
  } else {
    ckpt.tp = static_cast<int>(ranks.size());  // the engine without pipelining numbers mp_rank files by TP rank
  }
  ckpt.pp = static_cast<int>(ranks.size()) / ckpt.tp;
  if (ckpt.dp == 0) ckpt.dp = std::max<int64_t>(1, MetadataInt(ckpt.metadata[0], "dp_world_size", 1));
  RESHARD_RETURN_IF_ERROR(CheckRecordedDegrees(ckpt));
  RESHARD_ASSIGN_OR_RETURN(out.layout, CheckMoeFiles(m.files, ckpt, allowed));
  std::map<int, int> stage_of_layer;
  ExpertOrigins origins;
  for (int p = 0; p < ckpt.pp; ++p) BuildLayers(ranks, placed, p, ckpt.tp, &out, &stage_of_layer, &origins);
  for (const std::string& other : m.files.other_files) {
    ckpt.AddError("unrecognised file '" + other + "' in " + m.files.tag_dir +
                  "; reshard does not know what it holds (move it out of the tag "
                  "folder if it does not belong to the checkpoint)");
  }
  RESHARD_RETURN_IF_ERROR(DescribeCheckpoint(rules, options.set, &ckpt));
  RESHARD_RETURN_IF_ERROR(CheckExpertSplit(ckpt));
  RESHARD_RETURN_IF_ERROR(DescribeMoeBlocks(ckpt, stage_of_layer, origins, &out.layout));
  return out;
}

}  // namespace reshard
