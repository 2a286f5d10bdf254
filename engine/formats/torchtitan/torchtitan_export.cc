#include "formats/torchtitan/torchtitan_export.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "container/dcp_writer.h"
#include "formats/hf_common/hf_config.h"
#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/hf_tensors.h"
#include "formats/fsdp2_dcp.h"
#include "formats/hf_common/torchtitan_rules.h"
#include "formats/state_dict.h"
#include "formats/torchtitan/torchtitan_import.h"
#include "rules/size_expression.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kTorchtitan[] = "torchtitan";

Status CheckRequest(const SourceCheckpoint& src, const ExportOptions& options) {
  const RuleSet* rules = src.info().rules.get();
  if (rules != nullptr && rules->section<TorchtitanLayout>() == nullptr) {
    return Status::Unsupported("export --to torchtitan writes the keys of a rule set's torchtitan section, and rule set " +
                               rules->name() + " has none (" + rules->origin() + "); export --to hf or consolidated");
  }
  if (FormatCount(options, kDpShardOption) < 1) {
    return Status::InvalidInput("export --to torchtitan needs --dp-shard N (>= 1), the FSDP2 world size the "
                                "parameters are sharded over");
  }
  if (options.tp > 1 && rules != nullptr) {
    const std::vector<TorchtitanTensor>& tensors = rules->section<TorchtitanLayout>()->tensors;
    if (std::none_of(tensors.begin(), tensors.end(), [](const TorchtitanTensor& t) { return t.tp_dim >= 0; })) {
      return Status::Unsupported("rule set " + rules->name() + "'s torchtitan section (" + rules->origin() +
                                 ") declares no tensor's TP sharding (tp: {dim: ...}); add them (docs/rules.md) "
                                 "or leave out --tp");
    }
  }
  return Status::Ok();
}

// The checkpoint being planned: its tensors under torchtitan's keys, each
// cut into one file per rank.
class Writer {
 public:
  Writer(const RuleSet& rules, const HfExport& hf, const RuleInputs& inputs, Fsdp2Mesh mesh)
      : layout_(*rules.section<TorchtitanLayout>()), hf_(hf), inputs_(inputs), rules_name_(rules.name()), mesh_(mesh), files_(mesh) {
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
      out.push_back({prefix + key + suffix, t.dtype, t.shape, std::move(bytes), entry->tp_dim, std::move(from), {}});
    }
    return out;
  }

  // The torchtitan key of the HF tensor `hf`; "" when the section has none.
  std::string KeyOf(const std::string& hf) const {
    std::string block;
    const TorchtitanTensor* entry = EntryOf(hf, &block);
    return entry == nullptr ? "" : HfNameTemplate(entry->keys.front()).With(block);
  }

  // The items of every rank, and the files they make.
  Fsdp2Files& files() { return files_; }

 private:
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
  const Fsdp2Mesh mesh_;
  Fsdp2Files files_;
  std::vector<std::pair<std::unique_ptr<HfNameTemplate>, const TorchtitanTensor*>> entries_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

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
    writer->files().AddSharded(t, all);
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
  RESHARD_ASSIGN_OR_RETURN(float step, AdamwStep(groups));
  std::vector<std::string> defaulted;
  for (const std::string& moment : AdamwMoments()) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> states, AdamwMoment(all, params, moment, kTorchtitan));
    RESHARD_ASSIGN_OR_RETURN(std::vector<KeyedTensor> keyed,
                             KeyedTensors(hf, states, inputs, out, writer, kTorchtitanStatePrefix, "." + moment));
    for (const KeyedTensor& t : keyed) writer->files().AddSharded(t, all);
  }
  // Each parameter's step and hyperparameters, under each of its HF tensors' keys.
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> hf_tensors,
                           MapHfTensors(hf, params, inputs, out->scratch, &out->scratch_bytes));
  for (const StateDictTensor& t : hf_tensors) {
    const std::string key = writer->KeyOf(t.name);
    writer->files().AddStep(kTorchtitanStatePrefix + key + ".step", step);
    RESHARD_ASSIGN_OR_RETURN(Items fields, AdamwGroup(groups, CanonicalOfHf(hf, t.name), /*initial_lr_always=*/true, &defaulted));
    for (auto& [name, value] : fields) {
      writer->files().AddToRankZero(DcpBytesItem(kTorchtitanGroupsPrefix + key + "." + name.as_string(), std::move(value)));
    }
  }
  NoteAdamwDefaults(kTorchtitan, defaulted, notes);
  return Status::Ok();
}

// "FSDP2 Shard(0) over 4 ranks", or with TP "FSDP2 (dp_shard 2) x TP 2, 4 ranks".
std::string MeshSummary(const Fsdp2Mesh& mesh) {
  if (mesh.tp == 1) return "FSDP2 Shard(0) over " + Count(mesh.dp_shard, "rank");
  return "FSDP2 (dp_shard " + std::to_string(mesh.dp_shard) + ") x TP " + std::to_string(mesh.tp) + ", " +
         Count(mesh.ranks(), "rank");
}

Result<OutputPlan> PlanTorchtitan(const SourceCheckpoint& src, const ExportOptions& options,
                                  std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckRequest(src, options));
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(Fsdp2Source read, ReadFsdp2Source(src, inputs, options, kTorchtitan, &out, notes));
  const auto& [hf, all, optimizer, params] = read;
  const Fsdp2Mesh mesh{static_cast<int>(FormatCount(options, kDpShardOption)), std::max(options.tp, 1)};
  Writer writer(*src.info().rules, *hf, inputs, mesh);
  std::vector<std::string> keys;
  RESHARD_RETURN_IF_ERROR(AddModel(*hf, params, inputs, all, &out, &writer, &keys));
  if (optimizer) RESHARD_RETURN_IF_ERROR(AddOptimizer(src, *hf, params, inputs, all, &out, &writer, notes));

  const std::string folder = "step-" + std::to_string(src.info().iteration);
  RESHARD_RETURN_IF_ERROR(writer.files().AddTo(folder, &out));
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
  TargetFormatInfo info{kTorchtitan, "a torchtitan step-N/ checkpoint: FSDP2 over --dp-shard ranks, x --tp",
                        "the root holding step-N/"};
  info.tp = true;
  info.options = {DpShardOption(), FromOption("masters"), DTypeOption()};
  return {std::move(info), PlanTorchtitan};
}

}  // namespace reshard
