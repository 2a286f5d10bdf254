#include "formats/torchtitan/torchtitan_export.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "container/dcp_writer.h"
#include "formats/hf_common/hf_config.h"
#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_tensors.h"
#include "formats/state_dict.h"
#include "formats/torchtitan/torchtitan_import.h"
#include "rules/size_expression.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kDpShard[] = "dp-shard";  // the option naming the FSDP2 world size

// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;
// The moments of torch's AdamW, in its order; the master is the parameter.
const std::vector<std::string> kMoments = {"exp_avg", "exp_avg_sq"};

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

Status CheckRequest(const SourceCheckpoint& src, const ExportOptions& options) {
  const RuleSet* rules = src.info().rules.get();
  if (rules != nullptr && rules->torchtitan() == nullptr) {
    return Status::Unsupported("export --to torchtitan writes the keys of a rule set's torchtitan section, and rule set " +
                               rules->name() + " has none (" + rules->origin() + "); export --to hf or consolidated");
  }
  if (FormatCount(options, kDpShard) < 1) {
    return Status::InvalidInput("export --to torchtitan needs --dp-shard N (>= 1), the FSDP2 world size the "
                                "parameters are sharded over");
  }
  if (options.tp > 1 && rules != nullptr) {
    const std::vector<TorchtitanTensor>& tensors = rules->torchtitan()->tensors;
    if (std::none_of(tensors.begin(), tensors.end(), [](const TorchtitanTensor& t) { return t.tp_dim >= 0; })) {
      return Status::Unsupported("rule set " + rules->name() + "'s torchtitan section (" + rules->origin() +
                                 ") declares no tensor's TP sharding (tp: {dim: ...}); add them (docs/rules.md) "
                                 "or leave out --tp");
    }
  }
  return Status::Ok();
}

// One tensor of the checkpoint, whole: its key, how its bytes are made,
// the dim torchtitan's TP plan shards (-1: replicated on the TP mesh) and
// where it comes from (for --dry-run).
struct KeyedTensor {
  std::string key;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::function<ByteProducer(const std::vector<FullTensor>&)> bytes;
  int tp_dim = -1;
  std::string from;
};

// The ranks: torchtitan's device mesh [dp_shard, tp], TP the fastest
// (rank d * tp + t), as init_device_mesh numbers a 2-D mesh.
struct Mesh {
  int dp_shard = 1;
  int tp = 1;
  int ranks() const { return dp_shard * tp; }
};

// [first, first + count): what part `index` of torch.chunk into `parts`
// holds of `size` (shares of ceil(size / parts), the last ones shorter or
// empty), as DTensor's Shard cuts a dim.
struct Share {
  int64_t first = 0;
  int64_t count = 0;
};
Share ChunkShare(int64_t size, int parts, int index) {
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t first = std::min(size, index * chunk);
  return {first, std::min(size, first + chunk) - first};
}

// The checkpoint being planned: its tensors under torchtitan's keys, each
// cut into one file per rank.
class Writer {
 public:
  Writer(const RuleSet& rules, const HfExport& hf, const RuleInputs& inputs, Mesh mesh)
      : layout_(*rules.torchtitan()), hf_(hf), inputs_(inputs), rules_name_(rules.name()), mesh_(mesh) {
    for (const TorchtitanTensor& t : layout_.tensors) entries_.push_back({std::make_unique<HfNameTemplate>(t.hf), &t});
  }

  // The HF tensors `tensors` (MapHfTensors') under torchtitan's keys, each
  // between `prefix` and `suffix`, q/k rows interleaved per head.
  Result<std::vector<KeyedTensor>> Keyed(std::vector<StateDictTensor> tensors, const std::string& prefix,
                                         const std::string& suffix) {
    std::vector<KeyedTensor> out;
    for (StateDictTensor& t : tensors) {
      std::string block;
      const TorchtitanTensor* entry = EntryOf(t.name, &block);
      if (entry == nullptr) {
        return Status::Unsupported("rule set " + rules_name_ + "'s torchtitan section (line " +
                                   std::to_string(layout_.line) + ") has no key for the HF tensor " + t.name +
                                   "; add one (docs/rules.md)");
      }
      const std::string key = HfNameTemplate(entry->keys.front()).With(block);
      RESHARD_RETURN_IF_ERROR(CheckTpCut(key, *entry, t.shape));
      auto bytes = std::move(t.bytes);
      std::string from = std::move(t.detail);
      if (!entry->interleaved_heads.empty()) {
        from += ", heads interleaved";
        RESHARD_ASSIGN_OR_RETURN(std::vector<RowRun> runs, Interleaving(key, *entry, t.shape));
        const int64_t row_bytes = ShapeNumel(t.shape) / t.shape[0] * ElementSize(t.dtype);
        bytes = [bytes = std::move(bytes), row_bytes, runs = std::move(runs)](const std::vector<FullTensor>& s) {
          return GatherRows(bytes(s), row_bytes, runs);
        };
      }
      shapes_.emplace(key, t.shape);
      out.push_back({prefix + key + suffix, t.dtype, t.shape, std::move(bytes), entry->tp_dim, std::move(from)});
    }
    return out;
  }

  // The torchtitan key of the HF tensor `hf`; "" when the section has none.
  std::string KeyOf(const std::string& hf) const {
    std::string block;
    const TorchtitanTensor* entry = EntryOf(hf, &block);
    return entry == nullptr ? "" : HfNameTemplate(entry->keys.front()).With(block);
  }

  // `t` cut over the mesh: each rank's box (BoxOf) with its bytes; a rank
  // holding none writes no chunk.
  void AddSharded(const KeyedTensor& t, const std::vector<FullTensor>& sources) {
    const ByteProducer bytes = t.bytes(sources);
    for (int d = 0; d < mesh_.dp_shard; ++d) {
      for (int tp_rank = 0; tp_rank < mesh_.tp; ++tp_rank) {
        std::optional<Box> box = BoxOf(t, d, tp_rank);
        if (!box) continue;
        ByteProducer part = BoxBytes(t, bytes, *box, tp_rank);
        DcpWriteItem item = DcpTensorItem(t.key, t.dtype, t.shape, std::move(*box), std::move(part));
        item.from = t.from;
        files_[d * mesh_.tp + tp_rank].push_back(std::move(item));
      }
    }
  }

  // An item only rank 0 writes (a step, a hyperparameter): torch's planner
  // gives each replicated item to one rank.
  void AddToRankZero(DcpWriteItem item) { files_[0].push_back(std::move(item)); }

  std::vector<std::vector<DcpWriteItem>>& files() { return files_; }

 private:
  // What rank (d, tp_rank) holds of `t`, as DTensor places it on the mesh:
  // TP's share of t.tp_dim (Shard), then FSDP2's Shard(0) of the rows of
  // that share (FSDP2 shards the TP-local tensor again: a TP Shard(0)
  // tensor's _StridedShard(0)). Nothing for a rank without rows, and for a
  // TP replica but the first: it is written once, by the lowest rank, as
  // torch's planner may place it (dedup_save_to_lowest_rank).
  std::optional<Box> BoxOf(const KeyedTensor& t, int d, int tp_rank) const {
    if (t.tp_dim < 0 && tp_rank > 0) return std::nullopt;
    Box box{std::vector<int64_t>(t.shape.size(), 0), t.shape};
    if (t.shape.empty()) return d == 0 ? std::optional<Box>(box) : std::nullopt;
    if (t.tp_dim >= 0) {
      const Share share = ChunkShare(t.shape[t.tp_dim], mesh_.tp, tp_rank);
      box.offsets[t.tp_dim] = share.first;
      box.sizes[t.tp_dim] = share.count;
    }
    const Share rows = ChunkShare(box.sizes[0], mesh_.dp_shard, d);
    if (rows.count == 0) return std::nullopt;
    box.offsets[0] += rows.first;
    box.sizes[0] = rows.count;
    return box;
  }

  // The bytes of `box` of `t` (whole: `bytes`): a run of whole rows, or for
  // a TP Shard(1) box the TP rank's columns of each of its rows, one of the
  // tp equal pieces each row is (CheckTpCut).
  ByteProducer BoxBytes(const KeyedTensor& t, const ByteProducer& bytes, const Box& box, int tp_rank) const {
    if (t.shape.empty()) return bytes;
    const int64_t row_bytes = ShapeNumel(t.shape) / t.shape[0] * ElementSize(t.dtype);
    if (t.tp_dim != 1 || mesh_.tp == 1) return BytesFrom(bytes, box.offsets[0] * row_bytes);
    std::vector<RowRun> pieces;
    for (int64_t row = box.offsets[0]; row < box.offsets[0] + box.sizes[0]; ++row) {
      pieces.push_back({row * mesh_.tp + tp_rank, 1});
    }
    return GatherRows(bytes, row_bytes / mesh_.tp, std::move(pieces));
  }

  // Refuses a --tp that would cut `key` (of `shape`) unevenly or through one
  // of its entry's blocks: torchtitan's model gives each TP rank whole heads
  // (and an even share of the rest).
  Status CheckTpCut(const std::string& key, const TorchtitanTensor& entry, const std::vector<int64_t>& shape) const {
    if (entry.tp_dim < 0) return Status::Ok();
    const std::string dim = "dim " + std::to_string(entry.tp_dim);
    if (entry.tp_dim >= static_cast<int>(shape.size())) {
      return Status::InvalidInput(key + " has shape " + ShapeString(shape) + ", which has no " + dim + " to shard on "
                                  "the TP mesh; fix its tp in rule set " + rules_name_ + " (line " +
                                  std::to_string(entry.line) + ")");
    }
    if (mesh_.tp == 1) return Status::Ok();
    const int64_t size = shape[entry.tp_dim];
    int64_t blocks = size;
    if (!entry.tp_blocks.empty()) {
      RESHARD_ASSIGN_OR_RETURN(blocks, Size(entry.tp_blocks));
      if (blocks < 1 || size % blocks != 0) {
        return Status::InvalidInput(key + "'s " + dim + " (" + std::to_string(size) + ") is not " + std::to_string(blocks) +
                                    " blocks (" + entry.tp_blocks + "); check the model's sizes (--set)");
      }
    }
    if (blocks % mesh_.tp != 0) {
      const std::string what = entry.tp_blocks.empty() ? dim + " of size" : entry.tp_blocks + " =";
      return Status::InvalidInput("--tp " + std::to_string(mesh_.tp) + " does not divide " + key + "'s " + what + " " +
                                  std::to_string(blocks) + ", which torchtitan's TP plan shares out evenly; use a "
                                  "--tp that divides " + std::to_string(blocks));
    }
    return Status::Ok();
  }

  const TorchtitanTensor* EntryOf(const std::string& hf, std::string* block) const {
    for (const auto& [name, entry] : entries_) {
      if (name->Match(hf, block)) return entry;
    }
    return nullptr;
  }

  // The rows of `key` (of `shape`) as the entry's head count interleaves them.
  Result<std::vector<RowRun>> Interleaving(const std::string& key, const TorchtitanTensor& entry,
                                           const std::vector<int64_t>& shape) const {
    RESHARD_ASSIGN_OR_RETURN(int64_t heads, Size(entry.interleaved_heads));
    if (shape.size() != 2 || heads < 1 || shape[0] % (2 * heads) != 0) {
      return Status::InvalidInput(key + " has shape " + ShapeString(shape) + ", which is not " + std::to_string(heads) +
                                  " heads of an even number of rows (" + entry.interleaved_heads + ")");
    }
    return RotaryPairRows(shape[0], heads, true);
  }

  // The value of the size expression `text` (rules/size_expression.h).
  Result<int64_t> Size(const std::string& text) const {
    RESHARD_ASSIGN_OR_RETURN(SizeExpression e, ParseSizeExpression(text));
    return EvaluateSize(e, [this](const std::string& name, int64_t dim) { return Lookup(name, dim); });
  }

  // A size's term: a dim of a tensor keyed so far, or an HF config field.
  std::optional<int64_t> Lookup(const std::string& name, int64_t dim) const {
    if (dim >= 0) {
      auto it = shapes_.find(name);
      if (it == shapes_.end() || dim >= static_cast<int64_t>(it->second.size())) return std::nullopt;
      return it->second[dim];
    }
    for (const HfConfigField& f : hf_.config) {
      if (f.key != name) continue;
      Result<Value> v = HfConfigValue(f, inputs_);
      if (v.ok() && v->is(Value::Kind::kInt)) return v->as_int();
    }
    return std::nullopt;
  }

  const TorchtitanLayout& layout_;
  const HfExport& hf_;
  const RuleInputs& inputs_;
  const std::string rules_name_;
  const Mesh mesh_;
  std::vector<std::pair<std::unique_ptr<HfNameTemplate>, const TorchtitanTensor*>> entries_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::vector<std::vector<DcpWriteItem>> files_ = std::vector<std::vector<DcpWriteItem>>(mesh_.ranks());
};

// Whether the export writes the optimizer state: the source has some and
// --weights-only does not leave it out.
bool WritesOptimizer(const std::vector<FullTensor>& all, const ExportOptions& options) {
  return !options.weights_only &&
         std::any_of(all.begin(), all.end(), [](const FullTensor& t) { return t.section == "optimizer"; });
}

// The parameters: the fp32 masters where the source has them (torchtitan
// trains fp32 parameters, AdamW's masters), else the weights.
Result<std::vector<ChosenTensor>> ChooseParameters(const SourceCheckpoint& src, const std::vector<FullTensor>& all,
                                                   const ExportOptions& options, bool optimizer,
                                                   std::vector<std::string>* notes) {
  TensorChoiceOptions choice{"torchtitan", "--from weights", FormatOption(options, "from") == "weights", std::nullopt,
                             options.vocab_size ? options.vocab_size : src.info().vocab_size};
  RESHARD_ASSIGN_OR_RETURN(choice.dtype, ExportDType(FormatOption(options, "dtype")));
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> chosen, ChooseTensors(all, src.info().kind, choice, notes));
  if (!optimizer) return chosen;
  for (const ChosenTensor& t : chosen) {
    if (!t.master || t.dtype != DType::kFloat32) {
      return Status::InvalidInput("export --to torchtitan with the optimizer state writes the fp32 masters as the "
                                  "parameters (AdamW steps them), and " + t.name + " would be " +
                                  (t.master ? std::string(DTypeName(t.dtype)) : std::string("the weight")) +
                                  "; drop --from weights / --dtype, or add --weights-only");
    }
  }
  return chosen;
}

// Moment `moment` of every parameter of `params`, shaped and named like it.
Result<std::vector<ChosenTensor>> Moments(const std::vector<FullTensor>& all, const std::vector<ChosenTensor>& params,
                                          const std::string& moment) {
  std::map<std::string, size_t> of;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].section != "optimizer") continue;
    if (all[i].state != kFp32Master && std::find(kMoments.begin(), kMoments.end(), all[i].state) == kMoments.end()) {
      return Status::Unsupported("the optimizer state '" + all[i].state + "' of " + all[i].param + " has no place "
                                 "in torchtitan's AdamW state; export with --weights-only");
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
    out.push_back({p.name, it->second, all[it->second].dtype, DType::kFloat32, p.shape, true});
  }
  return out;
}

// The optimizer step as torch 2.6 keeps it per parameter: an fp32 0-d tensor.
Result<float> StepOf(const OptimizerParamGroups& groups) {
  if (!groups.step) return 0.0f;
  if (groups.step->is(Value::Kind::kInt)) return static_cast<float>(groups.step->as_int());
  if (groups.step->is(Value::Kind::kFloat)) return static_cast<float>(groups.step->as_float());
  return Status::Unsupported("the optimizer step " + groups.step->DebugString(40) +
                             " is not a number; export with --weights-only");
}

void AddOnce(const std::string& name, std::vector<std::string>* names) {
  if (std::find(names->begin(), names->end(), name) == names->end()) names->push_back(name);
}

// AdamW's fields of the group holding `param`, torch's defaults where the
// source records none (`defaulted` learns their names), and initial_lr;
// lists become tuples, as torch keeps betas.
Result<Items> AdamwGroup(const OptimizerParamGroups& groups, const std::string& param,
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
  // torch's LR schedulers add initial_lr to each group, and torchtitan builds
  // its scheduler before it loads, so dcp.load asks for it: without the
  // source's, the lr, which a new scheduler takes.
  const Value* initial = Find(group->hyperparameters, "initial_lr");
  if (initial == nullptr) AddOnce("initial_lr", defaulted);
  put("initial_lr", initial != nullptr ? *initial : *Find(group->hyperparameters, "lr"));
  return out;
}

// The canonical parameter the HF tensor `name` is (a part of): the
// hf.tensors entry that makes it, at its block.
std::string CanonicalOf(const HfExport& hf, const std::string& name) {
  for (const HfTensorMap& map : hf.tensors) {
    for (const std::string& to : map.to) {
      std::string block;
      if (HfNameTemplate(to).Match(name, &block)) return HfNameTemplate(map.from).With(block);
    }
  }
  return name;
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

// The HF tensors of `chosen`, under torchtitan's keys.
Result<std::vector<KeyedTensor>> KeyedTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                              const RuleInputs& inputs, OutputPlan* out, Writer* writer,
                                              const std::string& prefix, const std::string& suffix) {
  int64_t scratch_bytes = 0;
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> tensors,
                           MapHfTensors(hf, chosen, inputs, out->scratch, &scratch_bytes));
  out->scratch_bytes = std::max(out->scratch_bytes, scratch_bytes);
  return writer->Keyed(std::move(tensors), prefix, suffix);
}

// The model items, a tied head also under its own key (torch saves both).
Status AddModel(const HfExport& hf, const std::vector<ChosenTensor>& params, const RuleInputs& inputs,
                const std::vector<FullTensor>& all, OutputPlan* out, Writer* writer, std::vector<std::string>* keys) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<KeyedTensor> model, KeyedTensors(hf, params, inputs, out, writer, "", ""));
  for (const auto& [copy, of] : hf.tied) {
    const std::string key = writer->KeyOf(copy), tied = writer->KeyOf(of);
    auto it = std::find_if(model.begin(), model.end(), [&](const KeyedTensor& t) { return t.key == tied; });
    if (key.empty() || it == model.end()) continue;
    KeyedTensor head = *it;
    head.key = key;
    model.push_back(std::move(head));
  }
  for (const KeyedTensor& t : model) {
    writer->AddSharded(t, all);
    keys->push_back(t.key);
  }
  return Status::Ok();
}

// The AdamW items of each parameter of `params`, under the keys its HF
// tensors have (a tied copy has none: it is no parameter of its own).
Status AddOptimizer(const SourceCheckpoint& src, const HfExport& hf, const std::vector<ChosenTensor>& params,
                    const RuleInputs& inputs, const std::vector<FullTensor>& all, OutputPlan* out, Writer* writer,
                    std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_ASSIGN_OR_RETURN(float step, StepOf(groups));
  std::vector<std::string> defaulted;
  for (const std::string& moment : kMoments) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> states, Moments(all, params, moment));
    RESHARD_ASSIGN_OR_RETURN(std::vector<KeyedTensor> keyed,
                             KeyedTensors(hf, states, inputs, out, writer, kTorchtitanStatePrefix, "." + moment));
    for (const KeyedTensor& t : keyed) writer->AddSharded(t, all);
  }
  // Each parameter's step and hyperparameters, under each of its HF tensors' keys.
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> hf_tensors,
                           MapHfTensors(hf, params, inputs, out->scratch, &out->scratch_bytes));
  for (const StateDictTensor& t : hf_tensors) {
    const std::string key = writer->KeyOf(t.name);
    DcpWriteItem item = DcpTensorItem(kTorchtitanStatePrefix + key + ".step", DType::kFloat32, {}, Box{}, FloatBytes(step));
    item.from = "the source's optimizer step";
    writer->AddToRankZero(std::move(item));
    RESHARD_ASSIGN_OR_RETURN(Items fields, AdamwGroup(groups, CanonicalOf(hf, t.name), &defaulted));
    for (auto& [name, value] : fields) {
      writer->AddToRankZero(DcpBytesItem(kTorchtitanGroupsPrefix + key + "." + name.as_string(), std::move(value)));
    }
  }
  if (!defaulted.empty()) {
    const bool initial_lr = std::find(defaulted.begin(), defaulted.end(), "initial_lr") != defaulted.end();
    notes->push_back("torchtitan: the source's optimizer groups record no " + Join(defaulted, ", ") +
                     "; torch's AdamW defaults written" +
                     (initial_lr ? " (initial_lr: the lr, as torch's LR schedulers set it)" : ""));
  }
  return Status::Ok();
}

// "FSDP2 Shard(0) over 4 ranks", or with TP "FSDP2 (dp_shard 2) x TP 2, 4 ranks".
std::string MeshSummary(const Mesh& mesh) {
  if (mesh.tp == 1) return "FSDP2 Shard(0) over " + Count(mesh.dp_shard, "rank");
  return "FSDP2 (dp_shard " + std::to_string(mesh.dp_shard) + ") x TP " + std::to_string(mesh.tp) + ", " +
         Count(mesh.ranks(), "rank");
}

Result<OutputPlan> PlanTorchtitan(const SourceCheckpoint& src, const ExportOptions& options,
                                  std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckRequest(src, options));
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  RESHARD_ASSIGN_OR_RETURN(const HfExport* hf, FamilyExport(src, inputs));
  OutputPlan out;
  out.scratch = std::make_shared<ScratchFolder>();
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all,
                           WholeTensors(src, options.replicated, options.vocab_size, {}, out.read.get()));
  const bool optimizer = WritesOptimizer(all, options);
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> params, ChooseParameters(src, all, options, optimizer, notes));
  const Mesh mesh{static_cast<int>(FormatCount(options, kDpShard)), std::max(options.tp, 1)};
  Writer writer(*src.info().rules, *hf, inputs, mesh);
  std::vector<std::string> keys;
  RESHARD_RETURN_IF_ERROR(AddModel(*hf, params, inputs, all, &out, &writer, &keys));
  if (optimizer) RESHARD_RETURN_IF_ERROR(AddOptimizer(src, *hf, params, inputs, all, &out, &writer, notes));

  const std::string folder = "step-" + std::to_string(src.info().iteration);
  for (int rank = 0; rank < mesh.ranks(); ++rank) {
    if (writer.files()[rank].empty()) continue;  // no rows of any tensor
    RESHARD_ASSIGN_OR_RETURN(DcpFileLayout file,
                             LayOutDcpFile("__" + std::to_string(rank) + "_0.distcp", std::move(writer.files()[rank])));
    out.files.push_back(DcpDataFile(folder, "rank " + std::to_string(rank), std::move(file), kPartBytes));
  }
  std::vector<const PlannedFile*> data;
  for (const PlannedFile& f : out.files) data.push_back(&f);
  RESHARD_ASSIGN_OR_RETURN(PlannedFile metadata, DcpMetadataFile(folder, data));
  out.files.push_back(std::move(metadata));
  std::vector<std::string> left_out;
  RESHARD_ASSIGN_OR_RETURN(std::string model, RecordedConfigJson(*hf, inputs, params, all, &left_out));
  out.files.push_back(TextFile(folder + "/" + kTorchtitanModelFile, std::move(model)));
  out.summary = "torchtitan: " + MeshSummary(mesh) + ", step " +
                std::to_string(src.info().iteration) + "; " + Count(static_cast<int64_t>(keys.size()), "model tensor") +
                (optimizer ? "; AdamW state (exp_avg, exp_avg_sq, step, param_groups)" : "; weights only") + "\n";
  notes->push_back("torchtitan: no train_state, lr_scheduler or dataloader items: load with "
                   "--checkpoint.exclude_from_loading train_state,lr_scheduler,dataloader (they start afresh); "
                   "torchtitan keeps the model config in its run's args: run it with the source's, which " +
                   folder + "/" + kTorchtitanModelFile + " records for reshard as config.json fields" +
                   (left_out.empty() ? "" : " (but " + Join(left_out, ", ") + ", which the source does not record)"));
  return out;
}

}  // namespace

TargetFormat TorchtitanTarget() {
  TargetFormatInfo info{"torchtitan", "a torchtitan step-N/ checkpoint: FSDP2 over --dp-shard ranks, x --tp",
                        "the root holding step-N/"};
  info.tp = true;
  info.options = {{kDpShard, FormatOptionInfo::Kind::kCount,
                   "The FSDP2 world size every parameter and its AdamW state are sharded over (Shard(0), as "
                   "torch.chunk cuts dim 0); required (convert: 1 for a source saved whole)",
                   {}, false, "", /*layout=*/true},
                  FromOption("masters"), DTypeOption()};
  return {std::move(info), PlanTorchtitan};
}

}  // namespace reshard
