#include "formats/fsdp2_dcp.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;

// `box` cut along `axis` to what part `index` of torch.chunk into `parts`
// holds of it (shares of ceil(size / parts), the last ones shorter or
// empty), as DTensor's Shard cuts a dim.
Box ChunkShare(Box box, int axis, int parts, int index) {
  const int64_t size = box.sizes[axis];
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t first = std::min(size, index * chunk);
  box.offsets[axis] += first;
  box.sizes[axis] = std::min(size, first + chunk) - first;
  return box;
}

// torch 2.6's AdamW param group fields (initial_lr is a scheduler's, kept
// when the source has it), each with torch's default; none: the source
// must record it.
struct AdamwField {
  const char* name;
  std::optional<Value> fallback;
};
const std::vector<AdamwField>& AdamwFields() {
  static const std::vector<AdamwField> fields = {
      {"lr", std::nullopt},           {"betas", std::nullopt},          {"eps", std::nullopt},
      {"weight_decay", std::nullopt}, {"amsgrad", Value::Bool(false)},  {"foreach", Value::None()},
      {"maximize", Value::Bool(false)}, {"capturable", Value::Bool(false)}, {"differentiable", Value::Bool(false)},
      {"fused", Value::None()}};
  return fields;
}

ByteProducer FloatBytes(float value) {
  return [value](int64_t offset, int64_t length, uint8_t* dst) {
    uint8_t bytes[sizeof(float)];
    std::memcpy(bytes, &value, sizeof(float));
    if (offset < 0 || offset + length > static_cast<int64_t>(sizeof(float))) {
      return Status::Internal("a step's bytes requested out of range");
    }
    std::memcpy(dst, bytes + offset, static_cast<size_t>(length));
    return Status::Ok();
  };
}

void AddOnce(const std::string& name, std::vector<std::string>* names) {
  if (std::find(names->begin(), names->end(), name) == names->end()) names->push_back(name);
}

}  // namespace

FormatOptionInfo DpShardOption() {
  return {kDpShardOption, FormatOptionInfo::Kind::kCount,
          "The FSDP2 world size every parameter and its AdamW state are sharded over (Shard(0), as torch.chunk cuts "
          "dim 0); required (convert: 1 for a source saved whole)",
          {}, false, "", /*layout=*/true};
}

const std::vector<std::string>& AdamwMoments() {
  static const std::vector<std::string> moments = {"exp_avg", "exp_avg_sq"};
  return moments;
}

void Fsdp2Files::AddSharded(const KeyedTensor& t, const std::vector<FullTensor>& sources) {
  const ByteProducer bytes = t.bytes(sources);
  for (int d = 0; d < mesh_.dp_shard; ++d) {
    for (int tp_rank = 0; tp_rank < mesh_.tp; ++tp_rank) {
      std::optional<Box> box = BoxOf(t, d, tp_rank);
      if (!box) continue;
      ByteProducer part = BoxBytes(t, bytes, *box, tp_rank);
      DcpWriteItem item = DcpTensorItem(t.key, t.dtype, t.shape, std::move(*box), std::move(part));
      item.from = t.from;
      item.path = t.path;
      files_[d * mesh_.tp + tp_rank].push_back(std::move(item));
    }
  }
}

void Fsdp2Files::AddStep(const std::string& key, float step, std::vector<Value> path) {
  DcpWriteItem item = DcpTensorItem(key, DType::kFloat32, {}, Box{}, FloatBytes(step));
  item.from = "the source's optimizer step";
  item.path = std::move(path);
  AddToRankZero(std::move(item));
}

Status Fsdp2Files::AddTo(const std::string& folder, OutputPlan* out) {
  const size_t first = out->files.size();
  for (int rank = 0; rank < mesh_.ranks(); ++rank) {
    if (files_[rank].empty()) continue;  // no rows of any tensor
    RESHARD_ASSIGN_OR_RETURN(DcpFileLayout file,
                             LayOutDcpFile("__" + std::to_string(rank) + "_0.distcp", std::move(files_[rank])));
    out->files.push_back(DcpDataFile(folder, "rank " + std::to_string(rank), std::move(file), kPartBytes));
  }
  std::vector<const PlannedFile*> data;
  for (size_t i = first; i < out->files.size(); ++i) data.push_back(&out->files[i]);
  RESHARD_ASSIGN_OR_RETURN(PlannedFile metadata, DcpMetadataFile(folder, data));
  out->files.push_back(std::move(metadata));
  return Status::Ok();
}

// What rank (d, tp_rank) holds of `t`, as DTensor places it on the mesh:
// TP's share of t.tp_dim (Shard), then FSDP2's Shard(0) of the rows of that
// share (FSDP2 shards the TP-local tensor again: a TP Shard(0) tensor's
// _StridedShard(0)). Nothing for a rank without rows, and for a TP replica
// but the first: it is written once, by the lowest rank, as torch's planner
// may place it (dedup_save_to_lowest_rank).
std::optional<Box> Fsdp2Files::BoxOf(const KeyedTensor& t, int d, int tp_rank) const {
  if (t.tp_dim < 0 && tp_rank > 0) return std::nullopt;
  Box box = Box::Whole(t.shape);
  if (t.shape.empty()) return d == 0 ? std::optional<Box>(box) : std::nullopt;
  if (t.tp_dim >= 0) box = ChunkShare(std::move(box), t.tp_dim, mesh_.tp, tp_rank);
  box = ChunkShare(std::move(box), 0, mesh_.dp_shard, d);
  if (box.sizes[0] == 0) return std::nullopt;
  return box;
}

// The bytes of `box` of `t` (whole: `bytes`): a run of whole rows, or for a
// TP Shard(1) box the TP rank's columns of each of its rows, one of the tp
// equal pieces each row is (the target checks --tp divides the dim).
ByteProducer Fsdp2Files::BoxBytes(const KeyedTensor& t, const ByteProducer& bytes, const Box& box,
                                  int tp_rank) const {
  if (t.shape.empty()) return bytes;
  const int64_t row_bytes = ShapeNumel(t.shape) / t.shape[0] * ElementSize(t.dtype);
  if (t.tp_dim != 1 || mesh_.tp == 1) return BytesFrom(bytes, box.offsets[0] * row_bytes);
  std::vector<RowRun> pieces;
  for (int64_t row = box.offsets[0]; row < box.offsets[0] + box.sizes[0]; ++row) {
    pieces.push_back({row * mesh_.tp + tp_rank, 1});
  }
  return GatherRows(bytes, row_bytes / mesh_.tp, std::move(pieces));
}


Result<std::vector<ChosenTensor>> AdamwMoment(const std::vector<FullTensor>& all,
                                              const std::vector<ChosenTensor>& params, const std::string& moment,
                                              const std::string& to) {
  const std::vector<std::string>& moments = AdamwMoments();
  std::map<std::string, size_t> of;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].section != "optimizer") continue;
    if (all[i].state != kFp32Master && std::find(moments.begin(), moments.end(), all[i].state) == moments.end()) {
      return Status::Unsupported("the optimizer state '" + all[i].state + "' of " + all[i].param + " has no place "
                                 "in " + to + "'s AdamW state; export with --weights-only");
    }
    if (all[i].state == moment) of[all[i].param] = i;
  }
  std::vector<ChosenTensor> out;
  for (const ChosenTensor& p : params) {
    auto it = of.find(p.name);
    if (it == of.end()) {
      return Status::InvalidInput("the source has no optimizer " + moment + " of " + p.name +
                                  ", which AdamW needs; export with --weights-only");
    }
    // torch's AdamW keeps a moment in its parameter's dtype.
    out.push_back({p.name, it->second, all[it->second].dtype, p.dtype, p.shape, true});
  }
  return out;
}

Result<float> AdamwStep(const OptimizerParamGroups& groups) {
  if (!groups.step) return 0.0f;
  if (groups.step->is(Value::Kind::kInt)) return static_cast<float>(groups.step->as_int());
  if (groups.step->is(Value::Kind::kFloat)) return static_cast<float>(groups.step->as_float());
  return Status::Unsupported("the optimizer step " + groups.step->DebugString(40) +
                             " is not a number; export with --weights-only");
}

Result<Items> AdamwGroup(const OptimizerParamGroups& groups, const std::string& param, bool initial_lr_always,
                         std::vector<std::string>* defaulted) {
  auto group = std::find_if(groups.groups.begin(), groups.groups.end(), [&](const OptimizerParamGroup& g) {
    return std::find(g.params.begin(), g.params.end(), param) != g.params.end();
  });
  if (group == groups.groups.end()) {
    return Status::Internal("optimizer state of " + param + ", which is in no optimizer group");
  }
  Items out;
  auto put = [&out](const char* name, const Value& v) {
    out.emplace_back(Value::String(name), v.is(Value::Kind::kList) ? Value::MakeTuple(v.as_list().items) : v);
  };
  for (const AdamwField& f : AdamwFields()) {
    const Value* v = Find(group->hyperparameters, f.name);
    if (v == nullptr && !f.fallback) {
      return Status::Unsupported(std::string("the source's optimizer group of ") + param + " records no " + f.name +
                                 ", which AdamW needs; export with --weights-only");
    }
    if (v == nullptr) AddOnce(f.name, defaulted);
    put(f.name, v != nullptr ? *v : *f.fallback);
  }
  // torch's LR schedulers add initial_lr to each group, and a run that
  // builds its scheduler before it loads (torchtitan) asks dcp.load for it:
  // without the source's, the lr, which a new scheduler takes.
  const Value* initial = Find(group->hyperparameters, "initial_lr");
  if (initial == nullptr && !initial_lr_always) return out;
  if (initial == nullptr) AddOnce("initial_lr", defaulted);
  put("initial_lr", initial != nullptr ? *initial : *Find(group->hyperparameters, "lr"));
  return out;
}

void NoteAdamwDefaults(const std::string& to, const std::vector<std::string>& defaulted,
                       std::vector<std::string>* notes) {
  if (defaulted.empty()) return;
  const bool initial_lr = std::find(defaulted.begin(), defaulted.end(), "initial_lr") != defaulted.end();
  notes->push_back(to + ": the source's optimizer groups record no " + Join(defaulted, ", ") +
                   "; torch's AdamW defaults written" +
                   (initial_lr ? " (initial_lr: the lr, as torch's LR schedulers set it)" : ""));
}

Result<std::vector<StateDictTensor>> Fsdp2HfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                    const RuleInputs& inputs, OutputPlan* out) {
  int64_t scratch_bytes = 0;
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> tensors,
                           MapHfTensors(hf, chosen, inputs, out->scratch, &scratch_bytes));
  out->scratch_bytes = std::max(out->scratch_bytes, scratch_bytes);
  return tensors;
}

StateDictPrefix StateDictPrefix::Of(const std::vector<std::string>& words) {
  StateDictPrefix p;
  for (const std::string& word : words) {
    p.dotted += word + ".";
    p.path.push_back(Value::String(word));
  }
  return p;
}

std::vector<Value> StateDictPrefix::Path(std::vector<Value> rest) const {
  std::vector<Value> out = path;
  for (Value& v : rest) out.push_back(std::move(v));
  return out;
}

namespace {

KeyedTensor Keyed(StateDictTensor t, std::string key, std::vector<Value> path) {
  return {std::move(key), t.dtype, std::move(t.shape), std::move(t.bytes), -1, std::move(t.detail), std::move(path)};
}

}  // namespace

Result<int> Fsdp2StateDictWriter::AddModel(const Fsdp2Source& read, const RuleInputs& inputs, OutputPlan* out) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> model, Fsdp2HfTensors(*read.hf, read.params, inputs, out));
  for (const auto& [copy, of] : read.hf->tied) {
    auto named = [](const std::string& name) { return [&name](const StateDictTensor& t) { return t.name == name; }; };
    auto it = std::find_if(model.begin(), model.end(), named(of));
    if (it == model.end() || std::any_of(model.begin(), model.end(), named(copy))) continue;
    StateDictTensor head = *it;
    head.name = copy;
    model.push_back(std::move(head));
  }
  for (StateDictTensor& t : model) {
    const std::string key = model_.dotted + t.name;
    std::vector<Value> path = model_.Path({Value::String(t.name)});
    model_files_->AddSharded(Keyed(std::move(t), key, std::move(path)), read.all);
  }
  return static_cast<int>(model.size());
}

Status Fsdp2StateDictWriter::AddOptimizer(const SourceCheckpoint& src, const Fsdp2Source& read,
                                          const RuleInputs& inputs, const std::string& to, OutputPlan* out,
                                          std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_ASSIGN_OR_RETURN(float step, AdamwStep(groups));
  for (const std::string& moment : AdamwMoments()) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> states, AdamwMoment(read.all, read.params, moment, to));
    RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> mapped, Fsdp2HfTensors(*read.hf, states, inputs, out));
    for (StateDictTensor& t : mapped) {
      const std::string fqn = t.name;
      optim_files_->AddSharded(Keyed(std::move(t), StateKey(fqn, moment), StatePath(fqn, moment)), read.all);
    }
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> mapped, Fsdp2HfTensors(*read.hf, read.params, inputs, out));
  for (const StateDictTensor& t : mapped) {
    if (!index_groups_.empty() && !index_.count(t.name)) {
      return Status::InvalidInput("export --to " + to + ": the parameter " + t.name + " has no index among the "
                                  "source's parameters; write the optimizer state keyed by FQN");
    }
  }
  if (!index_groups_.empty() && index_.size() != mapped.size()) {
    return Status::InvalidInput("export --to " + to + ": the source numbers " + std::to_string(index_.size()) +
                                " parameters, the output has " + std::to_string(mapped.size()) + "; write the "
                                "optimizer state keyed by FQN");
  }
  std::vector<std::string> defaulted;
  std::vector<std::pair<std::string, Items>> fields_of;
  for (const StateDictTensor& t : mapped) {
    optim_files_->AddStep(StateKey(t.name, "step"), step, StatePath(t.name, "step"));
    RESHARD_ASSIGN_OR_RETURN(Items fields, AdamwGroup(groups, CanonicalOfHf(*read.hf, t.name),
                                                      /*initial_lr_always=*/false, &defaulted));
    fields_of.emplace_back(t.name, std::move(fields));
  }
  RESHARD_RETURN_IF_ERROR(AddGroups(fields_of));
  NoteAdamwDefaults(to, defaulted, notes);
  return Status::Ok();
}

void Fsdp2StateDictWriter::KeyByIndex(std::vector<std::vector<std::string>> groups) {
  index_groups_ = std::move(groups);
  index_.clear();
  for (const std::vector<std::string>& group : index_groups_) {
    for (const std::string& fqn : group) index_.emplace(fqn, static_cast<int64_t>(index_.size()));
  }
}

// The given groups, each with its first parameter's hyperparameters (a
// group has one set), its indices as params, and their FQNs as param_names
// (what torch records for an optimizer built from named_parameters(); a
// load into one built otherwise does not ask for them), which name each
// index whatever order the model's items are written in.
Status Fsdp2StateDictWriter::AddIndexedGroups(const std::vector<std::pair<std::string, Items>>& fields_of) {
  const std::map<std::string, Items> by_fqn(fields_of.begin(), fields_of.end());
  for (size_t g = 0; g < index_groups_.size(); ++g) {
    const std::vector<std::string>& group = index_groups_[g];
    if (group.empty()) continue;
    Items fields = by_fqn.at(group.front());
    std::vector<Value> params, names;
    for (const std::string& fqn : group) {
      if (Value::MakeDict(by_fqn.at(fqn)).DebugString() != Value::MakeDict(fields).DebugString()) {
        return Status::InvalidInput("the source trained " + group.front() + " and " + fqn + ", of one param group, "
                                    "with different hyperparameters; write the optimizer state keyed by FQN");
      }
      params.push_back(Value::Int(index_.at(fqn)));
      names.push_back(Value::String(fqn));
    }
    fields.emplace_back(Value::String("params"), Value::MakeList(std::move(params)));
    fields.emplace_back(Value::String("param_names"), Value::MakeList(std::move(names)));
    for (const auto& [name, value] : fields) {
      const std::string key = optim_.dotted + "param_groups." + std::to_string(g) + "." + name.as_string();
      AddObject(key, value, optim_.Path({Value::String("param_groups"), Value::Int(static_cast<int64_t>(g)), name}));
    }
  }
  return Status::Ok();
}

Status Fsdp2StateDictWriter::AddGroups(const std::vector<std::pair<std::string, Items>>& fields_of) {
  if (!index_groups_.empty()) return AddIndexedGroups(fields_of);
  if (flat_) {
    for (const auto& [fqn, fields] : fields_of) {
      for (const auto& [name, value] : fields) {
        const std::string rest = "param_groups." + fqn + "." + name.as_string();
        AddObject(optim_.dotted + rest, value, optim_.Path({Value::String(rest)}));
      }
    }
    return Status::Ok();
  }
  std::vector<std::pair<Items, std::vector<Value>>> merged;  // hyperparameters, FQNs
  for (const auto& [fqn, fields] : fields_of) {
    const std::string shown = Value::MakeDict(fields).DebugString();
    auto same = std::find_if(merged.begin(), merged.end(),
                             [&](const auto& g) { return Value::MakeDict(g.first).DebugString() == shown; });
    if (same == merged.end()) same = merged.insert(merged.end(), {fields, {}});
    same->second.push_back(Value::String(fqn));
  }
  for (size_t i = 0; i < merged.size(); ++i) {
    Items fields = merged[i].first;
    fields.emplace_back(Value::String("params"), Value::MakeList(merged[i].second));
    for (const auto& [name, value] : fields) {
      const std::string key = optim_.dotted + "param_groups." + std::to_string(i) + "." + name.as_string();
      AddObject(key, value, optim_.Path({Value::String("param_groups"), Value::Int(static_cast<int64_t>(i)), name}));
    }
  }
  return Status::Ok();
}

// The key a parameter's state is under: its FQN, or its index.
std::string Fsdp2StateDictWriter::StateKey(const std::string& fqn, const std::string& state) const {
  return optim_.dotted + "state." + StateName(fqn) + "." + state;
}

std::string Fsdp2StateDictWriter::StateName(const std::string& fqn) const {
  return index_groups_.empty() ? fqn : std::to_string(index_.at(fqn));
}

// torch's planner path of a state: nested (state, fqn, name), or one key of
// the flattened optimizer state dict.
std::vector<Value> Fsdp2StateDictWriter::StatePath(const std::string& fqn, const std::string& state) const {
  if (flat_) return optim_.Path({Value::String("state." + fqn + "." + state)});
  return optim_.Path({Value::String("state"), Value::String(StateName(fqn)), Value::String(state)});
}

void Fsdp2StateDictWriter::AddObject(const std::string& key, const Value& value, std::vector<Value> path) {
  DcpWriteItem item = DcpBytesItem(key, value);
  item.path = std::move(path);
  optim_files_->AddToRankZero(std::move(item));
}

namespace {

// The parameters, by the target's --from and --dtype: with the optimizer
// state, what AdamW steps: the fp32 masters, or the weights as stored of a
// run that keeps none (a bf16 run's); else a refusal naming `to`.
Result<std::vector<ChosenTensor>> ChooseFsdp2Parameters(const SourceCheckpoint& src, const std::vector<FullTensor>& all,
                                                        const ExportOptions& options, bool optimizer,
                                                        const std::string& to, std::vector<std::string>* notes) {
  // --weights-only reads no optimizer state, so no masters either.
  TensorChoiceOptions choice{to, options.weights_only ? "--weights-only" : "--from weights",
                             options.weights_only || FormatOption(options, "from") == "weights", std::nullopt,
                             options.vocab_size ? options.vocab_size : src.info().vocab_size};
  RESHARD_ASSIGN_OR_RETURN(choice.dtype, ExportDType(FormatOption(options, "dtype")));
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> chosen, ChooseTensors(all, src.info().kind, choice, notes));
  if (!optimizer) return chosen;
  const bool masters = HoldsFp32Masters(all);
  for (const ChosenTensor& t : chosen) {
    if (!masters && t.dtype != t.source_dtype) {
      return Status::InvalidInput("export --to " + to + " with the optimizer state writes the parameters as the run "
                                  "trained them (its AdamW keeps no fp32 master), and --dtype would make " + t.name +
                                  " " + DTypeName(t.dtype) + "; drop --dtype, or add --weights-only");
    }
    if (masters && (!t.master || t.dtype != DType::kFloat32)) {
      return Status::InvalidInput("export --to " + to + " with the optimizer state writes the fp32 masters as the "
                                  "parameters (AdamW steps them), and " + t.name + " would be " +
                                  (t.master ? std::string(DTypeName(t.dtype)) : std::string("the weight")) +
                                  "; drop --from weights / --dtype, or add --weights-only");
    }
  }
  return chosen;
}

}  // namespace

Result<Fsdp2Source> ReadFsdp2Source(const SourceCheckpoint& src, const RuleInputs& inputs,
                                    const ExportOptions& options, const std::string& to, OutputPlan* out,
                                    std::vector<std::string>* notes) {
  Fsdp2Source read;
  RESHARD_ASSIGN_OR_RETURN(read.hf, FamilyExport(src, inputs));
  out->scratch = std::make_shared<ScratchFolder>();
  RESHARD_ASSIGN_OR_RETURN(read.all, WholeTensors(src, options.replicated, options.vocab_size, {}, out->read.get()));
  read.optimizer = !options.weights_only && HoldsOptimizerState(read.all);
  RESHARD_ASSIGN_OR_RETURN(read.params, ChooseFsdp2Parameters(src, read.all, options, read.optimizer, to, notes));
  return read;
}

}  // namespace reshard
