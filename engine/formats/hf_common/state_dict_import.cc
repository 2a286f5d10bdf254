#include "formats/hf_common/state_dict_import.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <regex>
#include <set>

#include "formats/hf_common/hf_folder.h"
#include "formats/hf_common/hf_import.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "formats/hf_common/torchtitan_rules.h"
#include "logical/settings.h"
#include "rules/builtin_rules.h"
#include "rules/size_expression.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kStep[] = "step";
// The moments of torch's Adam and AdamW, in its order.
const std::vector<std::string> kAdamMoments = {"exp_avg", "exp_avg_sq"};

// A torchtitan.config value that is a number, not a size to compute.
bool IsLiteral(const std::string& text) {
  char* end = nullptr;
  std::strtod(text.c_str(), &end);
  return !text.empty() && *end == '\0';
}

std::string TopLevel(const std::string& key) { return key.substr(0, key.find('.')); }

// Whether stored key `key` is the model's.
bool IsModelKey(const StateDictKeys& keys, const std::string& key) {
  if (!keys.model_prefix.empty()) return StartsWith(key, keys.model_prefix);
  return std::find(keys.run_states.begin(), keys.run_states.end(), TopLevel(key)) == keys.run_states.end();
}

// A model key as the optimizer's state names it (its FQN): without the
// model's prefix, or the nesting an older save had (its optimizer's keys
// never had it).
std::string ModelKey(const StateDictKeys& keys, const std::string& stored) {
  const std::string& prefix = keys.model_prefix.empty() ? keys.nested_prefix : keys.model_prefix;
  return !prefix.empty() && StartsWith(stored, prefix) ? stored.substr(prefix.size()) : stored;
}

// The section's keys, compiled once: each model key's entry and block. With
// HF keys, an entry is matched by its `hf` name and the buffers skipped are
// the hf section's.
class KeyMap {
 public:
  KeyMap(const RuleSet& rules, bool hf_keys) {
    const TorchtitanLayout& layout = *rules.section<TorchtitanLayout>();
    for (const TorchtitanTensor& t : layout.tensors) {
      for (const std::string& k : hf_keys ? std::vector<std::string>{t.hf} : t.keys) {
        templates_.push_back({std::make_unique<HfNameTemplate>(k), &t});
      }
    }
    for (const std::string& k : hf_keys ? rules.section<HfExport>()->ignore : layout.ignore) {
      ignored_.push_back(std::make_unique<HfNameTemplate>(k));
    }
  }
  // Whether `key` is a buffer the model recomputes.
  bool Ignored(const std::string& key) const {
    std::string block;
    return std::any_of(ignored_.begin(), ignored_.end(), [&](const auto& t) { return t->Match(key, &block); });
  }
  // The entry of `key` (any alternative), and its block ("" outside blocks).
  const TorchtitanTensor* Find(const std::string& key, std::string* block) const {
    for (const auto& [name, entry] : templates_) {
      if (name->Match(key, block)) return entry;
    }
    return nullptr;
  }

 private:
  std::vector<std::pair<std::unique_ptr<HfNameTemplate>, const TorchtitanTensor*>> templates_;
  std::vector<std::unique_ptr<HfNameTemplate>> ignored_;
};

// The rows `rows` of `stored` (rows of `cols` elements), one after the other.
SourceShard GatheredRows(const SourceShard& stored, const std::vector<RowRun>& rows, int64_t cols, int element) {
  SourceShard out;
  int64_t at = 0;
  for (const RowRun& r : rows) {
    for (SourceShard::Run run : stored.RunsOf(r.first * cols, r.count * cols, element)) {
      run.begin += at;
      out.runs.push_back(std::move(run));
    }
    at += r.count * cols;
  }
  return out;
}

// One rule set's reading of the checkpoint.
class Reader {
 public:
  Reader(const DcpTensors& dcp, const StateDictKeys& names, const RuleSet& rules, const CommonOptions& options)
      : dcp_(dcp),
        names_(names),
        rules_(rules),
        layout_(*rules.section<TorchtitanLayout>()),
        keys_(rules, names.hf_keys),
        section_keys_(rules, false),
        options_(options) {}

  Result<StateDictImport> Read() {
    RESHARD_ASSIGN_OR_RETURN(settings_, SettingsValue(options_.set));
    RESHARD_RETURN_IF_ERROR(PlaceModelKeys());
    HfFolder folder;
    folder.dir = dcp_.folder;
    folder.files = dcp_.files;
    RESHARD_ASSIGN_OR_RETURN(std::optional<Value> recorded, RecordedConfig());
    const bool recorded_config = recorded.has_value();
    if (recorded) folder.files.push_back(RecordedConfigPath());
    folder.config_label = recorded ? RecordedConfigPath()
                                   : "the " + names_.label + " " + dcp_.folder + " (which records no model config)";
    folder.config_fix = "give it with";
    folder.tensors_label = "the " + names_.label;
    RESHARD_ASSIGN_OR_RETURN(folder.config, Config(recorded ? std::move(*recorded) : Value::MakeDict()));
    RESHARD_RETURN_IF_ERROR(AddTensors("", &folder));
    RESHARD_ASSIGN_OR_RETURN(HfImport hf, ImportHfModel(folder, rules_, options_));
    StateDictImport out;
    out.logical = std::move(hf.logical);
    out.notes = std::move(notes_);
    out.notes.insert(out.notes.end(), hf.notes.begin(), hf.notes.end());
    SetIteration(&out.logical.metadata[0], &out.logical.iteration);
    NoteRunStates(&out.notes);
    Result<std::optional<ImportedOptimizer>> optimizer = Optimizer(folder, out.logical);
    if (optimizer.ok()) {
      out.optimizer = std::move(*optimizer);
    } else {
      out.optimizer_status = optimizer.status();
    }
    out.files = folder.files;
    const SavedMesh mesh = MeshOfChunks();
    out.tp = mesh.tp;
    out.pp = mesh.dp_shard > 0 ? 1 : 0;
    out.dp = mesh.dp_shard;
    out.facts = Facts(out, recorded_config, mesh);
    out.what = names_.label + " (rule set " + rules_.name() + ": " + rules_.section<HfExport>()->architecture + " under " +
               KeysWhere() + "; " + std::to_string(dcp_.tensors.size()) + " tensors)";
    return out;
  }

 private:
  // Where the model's keys are, for `what`: "torchtitan's keys", "HF's
  // names (the model under model., the optimizer under optim.)".
  std::string KeysWhere() const {
    if (!names_.hf_keys) return names_.format + "'s keys";
    return "HF's names (the model " + (names_.model_prefix.empty() ? "at the top level" : "under " + names_.model_prefix) +
           (names_.optim_prefix.empty() ? ", saved alone)" : ", the optimizer under " + names_.optim_prefix + ")");
  }

  // Every model key's entry; a key the section does not map refuses the family.
  Status PlaceModelKeys() {
    for (const auto& [stored, tensor] : dcp_.tensors) {
      if (!IsModelKey(names_, stored)) continue;
      const std::string key = ModelKey(names_, stored);
      if (keys_.Ignored(key)) {
        ignored_.push_back(stored);
        continue;
      }
      std::string block;
      const TorchtitanTensor* entry = keys_.Find(key, &block);
      if (entry == nullptr) {
        return Status::Unsupported("rule set " + rules_.name() + ": the checkpoint's " + key + " is no " +
                                   (names_.hf_keys ? "HF name" : "key") + " of its torchtitan section (line " +
                                   std::to_string(layout_.line) + " of " + rules_.origin() + ")");
      }
      if (!block.empty()) blocks_.insert(block);
      hf_name_[key] = HfNameTemplate(entry->hf).With(block);
      entry_[key] = entry;
      stored_[key] = stored;
    }
    if (hf_name_.empty()) return Status::Unsupported("rule set " + rules_.name() + ": the checkpoint holds no model key");
    if (!ignored_.empty()) {
      notes_.push_back(names_.format + ": skipped what the model recomputes when it loads: " + Join(ignored_, ", "));
    }
    return Status::Ok();
  }

  // The stored tensor a section key names (any alternative of its entry;
  // with HF keys, its HF name).
  const ImportedTensor* Stored(const std::string& name) const {
    std::string block;
    const TorchtitanTensor* entry = section_keys_.Find(name, &block);
    std::vector<std::string> keys = entry ? entry->keys : std::vector<std::string>{name};
    if (entry && names_.hf_keys) keys = {entry->hf};
    const std::vector<std::string> prefixes = names_.model_prefix.empty()
                                                  ? std::vector<std::string>{"", names_.nested_prefix}
                                                  : std::vector<std::string>{names_.model_prefix};
    for (const std::string& k : keys) {
      for (const std::string& prefix : prefixes) {
        auto it = dcp_.tensors.find(prefix + HfNameTemplate(k).With(block));
        if (it != dcp_.tensors.end()) return &it->second;
      }
    }
    return nullptr;
  }

  // A size's term: a dim of a tensor, `blocks`, or a config field made so
  // far (--set's among them).
  std::optional<int64_t> Lookup(const Value& config, const std::string& name, int64_t dim) const {
    if (dim >= 0) {
      const ImportedTensor* t = Stored(name);
      if (t == nullptr || dim >= static_cast<int64_t>(t->tensor.as_tensor().sizes.size())) return std::nullopt;
      return t->tensor.as_tensor().sizes[dim];
    }
    if (name == "blocks") return static_cast<int64_t>(blocks_.size());
    if (const Value* v = Find(config, name); v != nullptr && v->is(Value::Kind::kInt)) return v->as_int();
    return std::nullopt;
  }

  Result<int64_t> Size(const Value& config, const std::string& text) const {
    RESHARD_ASSIGN_OR_RETURN(SizeExpression e, ParseSizeExpression(text));
    return EvaluateSize(e, [&](const std::string& name, int64_t dim) { return Lookup(config, name, dim); });
  }

  // The value --set gives for config field `key` (under the path hf.config
  // reads it into); null when none.
  const Value* GivenBySet(const std::string& key) const {
    for (const HfConfigField& f : rules_.section<HfExport>()->config) {
      if (f.key != key || f.paths.empty()) continue;
      if (const Value* v = RuleInputs{none_, settings_}.Find(f.paths.front())) return v;
    }
    return nullptr;
  }

  std::string RecordedConfigPath() const { return dcp_.folder + "/" + names_.recorded_config; }

  // The config export --to torchtitan recorded beside `.metadata`; none in
  // a folder torchtitan saved.
  Result<std::optional<Value>> RecordedConfig() const {
    std::error_code ec;
    if (names_.recorded_config.empty()) return std::optional<Value>();
    if (std::filesystem::symlink_status(RecordedConfigPath(), ec).type() == std::filesystem::file_type::not_found) {
      return std::optional<Value>();
    }
    RESHARD_ASSIGN_OR_RETURN(Value config, ReadJsonFile(RecordedConfigPath()));
    if (!config.is(Value::Kind::kDict)) {
      return Status::InvalidInput(RecordedConfigPath() + " does not hold a JSON object of config.json fields; "
                                  "restore the file that was saved, or remove it and give the "
                                  "model's config with --set");
    }
    return std::optional<Value>(std::move(config));
  }

  // config.json: the fields `recorded` gives (the export's record), then
  // those --set gives, then the section's: a size derived from the tensors,
  // or torchtitan's default, named in a note. A size whose terms are
  // unknown is left out: the HF import then names the --set that gives it.
  Result<Value> Config(Value recorded) {
    Value config = std::move(recorded);
    Set(config, "architectures", Value::MakeList({Value::String(rules_.section<HfExport>()->architecture)}));
    // What --set gives is the run's config, recorded as config.json would;
    // where the record says otherwise, the import refuses the contradiction.
    for (const HfConfigField& f : rules_.section<HfExport>()->config) {
      const Value* v = GivenBySet(f.key);
      if (v != nullptr && Find(config, f.key) == nullptr) Set(config, f.key, *v);
    }
    std::vector<std::string> defaults;
    for (const auto& [key, text] : layout_.config) {
      if (Find(config, key) != nullptr) continue;
      if (IsLiteral(text)) {
        const double number = std::strtod(text.c_str(), nullptr);
        const bool integral = text.find_first_of(".eE") == std::string::npos;
        Set(config, key, integral ? Value::Int(static_cast<int64_t>(number)) : Value::Float(number));
        defaults.push_back(key + " " + text);
        continue;
      }
      Result<int64_t> size = Size(config, text);
      if (size.ok()) Set(config, key, Value::Int(*size));
      if (!size.ok() && size.status().message().find("is not known") == std::string::npos) return size.status();
    }
    if (!defaults.empty()) {
      notes_.push_back(names_.format + ": the checkpoint records no model config; " + Join(defaults, ", ") + " are "
                       "torchtitan's defaults as rule set " + rules_.name() + " gives them; give the run's own with "
                       "--set where it used others");
    }
    return config;
  }

  // Whether HF tensor `hf` is a tied copy (torch saves a tied head under its
  // own key too), which has no optimizer state of its own.
  bool IsTiedCopy(const std::string& hf) const {
    const auto& tied = rules_.section<HfExport>()->tied;
    return std::any_of(tied.begin(), tied.end(), [&](const auto& tie) { return tie.first == hf; });
  }

  // The tensors of state `state` ("" for the weights) under their HF names.
  Status AddTensors(const std::string& state, HfFolder* folder) const {
    for (const auto& [key, hf] : hf_name_) {
      if (!state.empty() && IsTiedCopy(hf)) continue;
      const std::string stored_key = state.empty() ? stored_.at(key) : StateKey(key, state);
      auto it = dcp_.tensors.find(stored_key);
      if (it == dcp_.tensors.end()) {
        return Status::InvalidInput("the " + names_.label + " has " + key + " but no " + stored_key +
                                    "; its optimizer state is incomplete (pass --weights-only to read the weights)");
      }
      const Tensor& t = it->second.tensor.as_tensor();
      SourceShard runs = *it->second.runs;
      // HF's own rows need no reordering: only the section's keys hold
      // interleaved rotary pairs.
      if (const std::string& heads = entry_.at(key)->interleaved_heads; !heads.empty() && !names_.hf_keys) {
        Result<int64_t> n = Size(folder->config, heads);
        if (!n.ok()) return NeedsSet(key, n.status());
        const int64_t rows = t.sizes.empty() ? 0 : t.sizes[0];
        if (t.sizes.size() != 2 || *n < 1 || rows % (2 * *n) != 0) {
          return Status::InvalidInput("the " + names_.label + "'s " + key + " has shape " + ShapeString(t.sizes) +
                                      ", which is not " + std::to_string(*n) + " heads of an even number of rows (" +
                                      heads + ")");
        }
        runs = GatheredRows(runs, RotaryPairRows(rows, *n, false), t.sizes[1], ElementSize(t.storage->dtype));
      }
      folder->tensors[hf] = it->second.tensor;
      folder->runs[hf] = std::move(runs);
    }
    return Status::Ok();
  }

  // The step torchtitan names the folder after (step-N) is the iteration.
  // The size of `key` the tensors do not give: the config fields the
  // section's sizes name that only --set gives, as the refusal's fix.
  Status NeedsSet(const std::string& key, const Status& why) const {
    std::vector<std::string> sets;
    auto add = [&](const std::string& text) {
      Result<SizeExpression> e = ParseSizeExpression(text);
      for (const SizeTerm& term : e.ok() ? e->terms : std::vector<SizeTerm>{}) {
        const bool derived = term.name == "blocks" || std::any_of(layout_.config.begin(), layout_.config.end(),
                                                                   [&](const auto& c) { return c.first == term.name; });
        const std::string set = "--set " + term.name + "=N";
        if (term.kind == SizeTerm::Kind::kName && !derived && std::find(sets.begin(), sets.end(), set) == sets.end()) {
          sets.push_back(set);
        }
      }
    };
    for (const auto& [k, text] : layout_.config) {
      if (!IsLiteral(text)) add(text);
    }
    for (const TorchtitanTensor& t : layout_.tensors) add(t.interleaved_heads);
    return Status::InvalidInput("the " + names_.label + " records no model config, and " + key + " needs what its "
                                "tensors do not say (" + why.message() + "); give the run's model args: " + Join(sets, " "));
  }

  void SetIteration(Value* metadata, int64_t* logical_iteration) const {
    static const std::regex step(".*step-([0-9]+)/?$");
    std::smatch m;
    int64_t iteration = names_.iteration.value_or(0);
    if (!names_.iteration && (!std::regex_match(dcp_.folder, m, step) || !ParseInt(m[1].str(), &iteration))) return;
    Set(*metadata, "iteration", Value::Int(iteration));
    SetPath(metadata, "args.iteration", Value::Int(iteration));
    *logical_iteration = iteration;
  }

  // torchtitan's mesh [dp_shard, tp] (0: not shown).
  struct SavedMesh {
    int tp = 0, dp_shard = 0;
  };

  // The mesh as the chunks show it for certain. TP: the chunks along dim 1
  // of the tensors its TP plan shards there (RowwiseParallel's), the same
  // for all. FSDP2 cuts dim 0 of every tensor into at most dp_shard chunks
  // (fewer where it has fewer rows), and dp_shard x TP ranks are at most
  // the ranks that wrote: a tensor not TP-cut along dim 0 in world / TP
  // chunks there makes dp_shard world / TP, and every rank one of the
  // mesh's (no PP, CP or replicated DP).
  SavedMesh MeshOfChunks() const {
    SavedMesh mesh;
    for (const auto& [key, entry] : entry_) {
      if (entry->tp_dim != 1) continue;
      const int n = ChunksAlong(stored_.at(key), 1);
      if (n == 0 || (mesh.tp != 0 && n != mesh.tp)) return {};
      mesh.tp = n;
    }
    const int world = dcp_.writing_ranks;
    if (mesh.tp == 0 || world == 0 || world % mesh.tp != 0) return mesh;
    for (const auto& [key, entry] : entry_) {
      if (entry->tp_dim != 0 && ChunksAlong(stored_.at(key), 0) == world / mesh.tp) {
        mesh.dp_shard = world / mesh.tp;
        break;
      }
    }
    return mesh;
  }

  // The cuts of `stored` along `axis`, as its chunks show them (0: unknown).
  int ChunksAlong(const std::string& stored, int axis) const {
    auto it = dcp_.chunks.find(stored);
    return it == dcp_.chunks.end() ? 0 : DistinctStartsAlong(it->second, axis);
  }

  // What the step records, in torchtitan's terms.
  RecordedFacts Facts(const StateDictImport& out, bool recorded_config, const SavedMesh& mesh) const {
    RecordedFacts facts;
    facts.emplace_back("step", out.logical.iteration > 0 ? std::to_string(out.logical.iteration)
                                                         : "not recorded (" + (names_.iteration_from.empty()
                                                                                   ? "the folder is not named step-N"
                                                                                   : "no " + names_.iteration_from) +
                                                               ")");
    std::string shown = mesh.dp_shard > 0 ? "dp_shard " + std::to_string(mesh.dp_shard) : "dp_shard not shown";
    shown += mesh.tp > 0 ? ", tp " + std::to_string(mesh.tp) : ", tp not shown";
    if (dcp_.writing_ranks > 0) shown += " (the chunks; " + Count(dcp_.writing_ranks, "rank") + " wrote it)";
    facts.emplace_back("mesh", shown);
    facts.emplace_back("model config", recorded_config ? names_.recorded_config
                                                       : "not recorded (sizes from the tensors' shapes and --set)");
    std::string optimizer = "none";
    if (out.optimizer) {
      optimizer = out.optimizer->what + (out.optimizer->step ? ", step " + out.optimizer->step->DebugString(20) : "");
    } else if (!out.optimizer_status.ok()) {
      optimizer = "not read (" + out.optimizer_status.message() + ")";
    }
    facts.emplace_back("optimizer state", optimizer);
    const int64_t data_files = std::count_if(dcp_.files.begin(), dcp_.files.end(),
                                             [](const std::string& f) { return EndsWith(f, ".distcp"); });
    facts.emplace_back("files", Count(data_files, ".distcp file") + ", " +
                                    Count(static_cast<int64_t>(dcp_.tensors.size()), "tensor"));
    return facts;
  }

  void NoteRunStates(std::vector<std::string>* notes) const {
    std::set<std::string> left;
    for (const auto& [key, t] : dcp_.tensors) {
      if (!IsModelKey(names_, key) && !StartsWith(key, names_.optim_prefix)) left.insert(TopLevel(key));
    }
    for (const std::string& key : dcp_.objects) {
      if (!IsModelKey(names_, key) && !StartsWith(key, names_.optim_prefix)) left.insert(TopLevel(key));
    }
    if (left.empty()) return;
    notes->push_back(names_.format + ": " + Join(std::vector<std::string>(left.begin(), left.end()), ", ") +
                     " not carried (no other format keeps " + names_.format + "'s run state)");
  }

  // The key of state `state` of model key `key` in the optimizer's state dict.
  std::string StateKey(const std::string& key, const std::string& state) const {
    return names_.optim_prefix + "state." + key + "." + state;
  }

  // ---- the optimizer ----

  Result<std::optional<ImportedOptimizer>> Optimizer(const HfFolder& weights, const LogicalCheckpoint& ckpt) const {
    std::vector<std::string> moments;
    for (const auto& [key, t] : dcp_.tensors) {
      if (!StartsWith(key, names_.optim_prefix + "state.")) continue;
      const std::string state = key.substr(key.rfind('.') + 1);
      if (state != kStep && std::find(moments.begin(), moments.end(), state) == moments.end()) moments.push_back(state);
    }
    if (moments.empty()) return std::optional<ImportedOptimizer>();
    std::sort(moments.begin(), moments.end());  // exp_avg, exp_avg_sq: torch's order
    if (moments != kAdamMoments) {
      return Status::Unsupported("the " + names_.label + "'s optimizer state (" + names_.optim_prefix + "state.) holds " +
                                 Join(moments, ", ") + " per parameter, not Adam's exp_avg and exp_avg_sq: reshard "
                                 "carries the state of torch's Adam and AdamW only; pass --weights-only to read the model");
    }
    const RuleInputs inputs{ckpt.metadata[0], ckpt.settings};
    HfFolder params = weights;
    for (const auto& [copy, to] : rules_.section<HfExport>()->tied) {
      params.tensors.erase(copy);
      params.runs.erase(copy);
    }
    RESHARD_ASSIGN_OR_RETURN(auto masters, JoinHfTensors(params, rules_, inputs));
    ImportedOptimizer out;
    out.moments = moments;
    out.layout = names_.format;
    // torch's AdamW keeps each moment in its parameter's dtype: fp32
    // parameters are their own masters, bf16 ones have none.
    RESHARD_ASSIGN_OR_RETURN(out.moments_dtype, ParamsDType(masters));
    out.what = names_.format + "'s AdamW state (" + Join(moments, ", ") +
               (out.masters() ? std::string("; the fp32 parameters as masters)")
                            : std::string("; ") + DTypeName(out.moments_dtype) + " parameters, no fp32 master)");
    for (auto& [name, t] : masters) out.params[name].master = out.masters() ? ShardOf(t) : SourceShard();
    for (const std::string& moment : moments) {
      HfFolder states = weights;
      states.tensors.clear();
      states.runs.clear();
      RESHARD_RETURN_IF_ERROR(AddTensors(moment, &states));
      RESHARD_ASSIGN_OR_RETURN(auto joined, JoinHfTensors(states, rules_, inputs));
      for (auto& [name, t] : joined) {
        const DType dtype = t.tensor.as_tensor().storage->dtype;
        if (dtype != out.moments_dtype) {
          return Status::Unsupported("the " + names_.label + "'s " + moment + " of " + name + " is " + DTypeName(dtype) +
                                     ", its parameter " + DTypeName(out.moments_dtype) + " (torch's AdamW keeps them "
                                     "alike); pass --weights-only to read the weights");
        }
        out.params[name].moments.push_back(ShardOf(t));
      }
    }
    RESHARD_ASSIGN_OR_RETURN(out.step, Step());
    RESHARD_ASSIGN_OR_RETURN(out.param_groups, ParamGroups());
    return std::optional<ImportedOptimizer>(std::move(out));
  }

  // The one floating dtype of every parameter.
  Result<DType> ParamsDType(const std::map<std::string, ImportedTensor>& params) const {
    std::optional<DType> dtype;
    for (const auto& [name, t] : params) {
      const DType d = t.tensor.as_tensor().storage->dtype;
      if (!dtype) dtype = d;
      if (d != *dtype || !IsFloatingPoint(d)) {
        return Status::Unsupported("the " + names_.label + "'s parameters are not of one floating dtype (" + name +
                                   " is " + DTypeName(d) + "); pass --weights-only to read the weights");
      }
    }
    return dtype.value_or(DType::kFloat32);
  }

  static SourceShard ShardOf(const ImportedTensor& t) {
    return t.runs ? *t.runs : SourceShard::Of(t.tensor.as_tensor(), {});
  }

  // Every parameter's step (torch keeps one each); they must agree.
  Result<std::optional<Value>> Step() const {
    std::optional<double> step;
    for (const auto& [key, hf] : hf_name_) {
      auto it = dcp_.tensors.find(StateKey(key, kStep));
      if (it == dcp_.tensors.end()) continue;
      const Tensor& t = it->second.tensor.as_tensor();
      if (t.numel() != 1 || t.storage->dtype != DType::kFloat32) {
        return Status::InvalidInput("the " + names_.label + "'s " + it->first + " is not one fp32 step count");
      }
      float v = 0;
      it->second.runs->Copy(0, 1, sizeof(float), reinterpret_cast<uint8_t*>(&v), nullptr);
      if (step && *step != v) {
        return Status::InvalidInput("the " + names_.label + "'s parameters have taken different numbers of "
                                    "optimizer steps (" + it->first + " is " + std::to_string(v) + ")");
      }
      step = v;
    }
    if (!step) return std::optional<Value>();
    return std::optional<Value>(Value::Int(static_cast<int64_t>(*step)));
  }

  // The param groups as Megatron lays them out (reshard's targets do):
  // the matrices' group, then the vectors' (norms, biases), each with the
  // hyperparameters the optimizer kept for its parameters, which must
  // agree. torchtitan decays every parameter by default: the vectors' group
  // then keeps that weight decay, as the run trained.
  Result<std::vector<Value>> ParamGroups() const {
    RESHARD_ASSIGN_OR_RETURN(auto by_key, HyperparametersByKey());
    std::optional<Value> groups[2];  // matrices, vectors
    for (const auto& [key, hf] : hf_name_) {
      if (IsTiedCopy(hf)) continue;
      auto it = by_key.find(key);
      if (it == by_key.end()) {
        return Status::InvalidInput("the " + names_.label + "'s optimizer has no param_groups entry of " + key +
                                    "; pass --weights-only to read the weights");
      }
      const bool matrix = dcp_.tensors.at(stored_.at(key)).tensor.as_tensor().sizes.size() >= 2;
      Value group = Value::MakeDict(it->second);
      std::optional<Value>& slot = groups[matrix ? 0 : 1];
      if (slot && slot->DebugString() != group.DebugString()) {
        return Status::Unsupported("the " + names_.format + " run trained its " + (matrix ? "matrices" : "vectors") +
                                   " with different hyperparameters (" + key + ": " + group.DebugString(120) +
                                   "), which Megatron's two param groups cannot hold; pass --weights-only");
      }
      slot = std::move(group);
    }
    std::vector<Value> out;
    for (std::optional<Value>& g : groups) {
      if (g) out.push_back(std::move(*g));
    }
    return out;
  }

  // Each model key's hyperparameters, from flat param groups
  // (`param_groups.<key>.<name>`) or torch's own (`param_groups.<i>.<name>`
  // with the group's keys in `param_groups.<i>.params`).
  Result<std::map<std::string, Items>> HyperparametersByKey() const {
    const std::string prefix = names_.optim_prefix + "param_groups.";
    std::map<std::string, Items> by_key;    // model key -> its hyperparameters
    std::map<std::string, Items> by_group;  // group index -> its hyperparameters
    std::map<std::string, Value> members;   // group index -> its `params`
    for (const std::string& object : dcp_.objects) {
      if (!StartsWith(object, prefix)) continue;
      const std::string rest = object.substr(prefix.size());
      const size_t dot = rest.rfind('.');
      if (dot == std::string::npos) continue;
      const std::string head = rest.substr(0, dot), name = rest.substr(dot + 1);
      int64_t index = 0;
      const bool group = !hf_name_.count(head) && ParseInt(head, &index);
      if (!group && !hf_name_.count(head)) continue;
      RESHARD_ASSIGN_OR_RETURN(Value v, dcp_.read_object(object));
      if (group && name == "params") {
        members[head] = std::move(v);
      } else {
        (group ? by_group[head] : by_key[head]).emplace_back(Value::String(name), std::move(v));
      }
    }
    for (const auto& [index, params] : members) {
      if (!params.is(Value::Kind::kList)) {
        return Status::InvalidInput("the " + names_.label + "'s " + prefix + index + ".params is no list of "
                                    "parameter names; pass --weights-only to read the weights");
      }
      for (const Value& key : params.as_list().items) {
        if (key.is(Value::Kind::kString)) by_key[key.as_string()] = by_group[index];
      }
    }
    return by_key;
  }

  const DcpTensors& dcp_;
  const StateDictKeys& names_;
  const RuleSet& rules_;
  const TorchtitanLayout& layout_;
  const KeyMap keys_;          // the model's keys
  const KeyMap section_keys_;  // the section's keys, which its sizes name
  const CommonOptions& options_;
  Value settings_;
  const Value none_ = Value::MakeDict();
  std::set<std::string> blocks_;
  std::map<std::string, std::string> hf_name_;                // model key -> HF name
  std::map<std::string, const TorchtitanTensor*> entry_;      // model key -> its entry
  std::map<std::string, std::string> stored_;                 // model key -> the key it is stored under
  std::vector<std::string> ignored_;  // stored keys of recomputed buffers
  std::vector<std::string> notes_;
};

Result<std::vector<RuleSet>> Candidates(const std::string& spec, const StateDictKeys& keys) {
  return RuleSetsWithSection(spec, "torchtitan", [](const RuleSet& r) { return r.section<TorchtitanLayout>() != nullptr; },
                             "a " + keys.label);
}

}  // namespace

bool HoldsSectionModelKey(const DcpTensors& dcp, const StateDictKeys& keys, const std::string& rules_spec) {
  Result<std::vector<RuleSet>> candidates = Candidates(rules_spec, keys);
  if (!candidates.ok()) return !rules_spec.empty();
  for (const RuleSet& rules : *candidates) {
    const KeyMap map(rules, keys.hf_keys);
    for (const auto& [stored, t] : dcp.tensors) {
      if (!IsModelKey(keys, stored)) continue;
      // A key that is also its entry's HF name (torchtitan's lm_head.weight)
      // tells the section's naming from HF's only with HF keys asked for.
      const std::string key = ModelKey(keys, stored);
      std::string block;
      const TorchtitanTensor* entry = map.Find(key, &block);
      if (entry != nullptr && (keys.hf_keys || HfNameTemplate(entry->hf).With(block) != key)) return true;
    }
  }
  return false;
}

Result<StateDictImport> ReadStateDictImport(const DcpTensors& dcp, const StateDictKeys& keys,
                                            const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> candidates, Candidates(options.rules, keys));
  // The first family whose model the checkpoint holds (a tied Llama has no
  // output.weight the untied family needs); else the first refusal.
  Status refusal = Status::Ok();
  for (const RuleSet& rules : candidates) {
    Result<StateDictImport> imported = Reader(dcp, keys, rules, options).Read();
    if (imported.ok()) return imported;
    if (refusal.ok()) refusal = imported.status();
  }
  return refusal;
}

}  // namespace reshard
