#include "formats/fsdp2_dcp.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_tensors.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;

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
    out.push_back({p.name, it->second, all[it->second].dtype, DType::kFloat32, p.shape, true});
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

namespace {

// The parameters, by the target's --from and --dtype: with the optimizer
// state, the fp32 masters (AdamW steps them) or a refusal naming `to`.
Result<std::vector<ChosenTensor>> ChooseFsdp2Parameters(const SourceCheckpoint& src, const std::vector<FullTensor>& all,
                                                        const ExportOptions& options, bool optimizer,
                                                        const std::string& to, std::vector<std::string>* notes) {
  TensorChoiceOptions choice{to, "--from weights", FormatOption(options, "from") == "weights", std::nullopt,
                             options.vocab_size ? options.vocab_size : src.info().vocab_size};
  RESHARD_ASSIGN_OR_RETURN(choice.dtype, ExportDType(FormatOption(options, "dtype")));
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> chosen, ChooseTensors(all, src.info().kind, choice, notes));
  if (!optimizer) return chosen;
  for (const ChosenTensor& t : chosen) {
    if (!t.master || t.dtype != DType::kFloat32) {
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
  read.optimizer = !options.weights_only && std::any_of(read.all.begin(), read.all.end(), [](const FullTensor& t) {
    return t.section == "optimizer";
  });
  RESHARD_ASSIGN_OR_RETURN(read.params, ChooseFsdp2Parameters(src, read.all, options, read.optimizer, to, notes));
  return read;
}

}  // namespace reshard
