#include "formats/state_dict.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "container/safetensors_writer.h"
#include "container/torch_file.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// The size of the ranges a safetensors file of `bytes` is written in: a
// quarter of it, so that two workers (or four) share a file that is written
// alone, but at least 16 MiB, against which a range's open costs nothing,
// and at most 256 MiB, so that the last ranges of big files balance.
int64_t PartBytes(int64_t bytes) { return std::clamp<int64_t>(bytes / 4, int64_t{16} << 20, int64_t{256} << 20); }

// The safetensors form of `tensors`, their bytes made from `sources` (or
// unset, for planning).
std::vector<SafetensorsTensor> SafetensorsTensors(const std::vector<StateDictTensor>& tensors,
                                                  const std::vector<FullTensor>* sources) {
  std::vector<SafetensorsTensor> out;
  for (const StateDictTensor& t : tensors) {
    out.push_back({t.name, t.dtype, t.shape, sources != nullptr ? t.bytes(*sources) : ByteProducer()});
  }
  return out;
}

const std::map<std::string, std::string> kSafetensorsMetadata = {{"format", "pt"}};

// Which source tensor each exported parameter comes from, and its shape.
class TensorChoice {
 public:
  TensorChoice(const std::vector<FullTensor>& all, const TensorChoiceOptions& options)
      : all_(all), options_(options) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i].state == kFp32Master) masters_[all[i].param] = i;
    }
  }

  Result<std::vector<ChosenTensor>> Choose(const std::string& kind, std::vector<std::string>* notes) const {
    // A source that lists no weights (ZeRO-3 keeps only placeholders) gives
    // its masters as the weights.
    const bool has_weights = std::any_of(all_.begin(), all_.end(),
                                         [](const FullTensor& t) { return t.section == "weights"; });
    if (!has_weights && options_.from_weights) {
      return Status::InvalidInput("a " + kind + " checkpoint keeps its weights only as fp32 masters; "
                                  "drop " + options_.weights_flag);
    }
    if (!has_weights && !masters_.empty()) {
      notes->push_back(options_.what + ": a " + kind + " checkpoint lists its fp32 masters only; buffers "
                       "and frozen parameters, where it has any, are not exported");
    }
    std::vector<ChosenTensor> out;
    std::set<std::string> seen;
    int from_masters = 0;
    for (size_t i = 0; i < all_.size(); ++i) {
      const FullTensor& w = all_[i];
      if (w.section != "weights" && !(!has_weights && w.state == kFp32Master)) continue;
      if (!seen.insert(w.param).second) {
        return Status::Unsupported("a " + kind + " checkpoint lists " + w.param + " once per rank, not "
                                   "whole; " + options_.what + " export reads checkpoints whose tensors "
                                   "are described whole by rules");
      }
      RESHARD_ASSIGN_OR_RETURN(ChosenTensor t, Make(i));
      from_masters += t.master ? 1 : 0;
      out.push_back(std::move(t));
    }
    if (out.empty()) {
      return Status::Unsupported("a " + kind + " checkpoint does not list its weights whole; " +
                                 options_.what + " export reads checkpoints whose tensors are described "
                                 "whole by rules");
    }
    const int n = static_cast<int>(out.size());
    notes->push_back(options_.what + ": " + std::to_string(from_masters) + " of " + std::to_string(n) +
                     " tensors from the fp32 masters" +
                     (options_.from_weights ? " (" + options_.weights_flag + ")"
                      : masters_.empty()    ? std::string(HoldsOptimizerState(all_) ? " (its optimizer keeps none)"
                                                                     : " (the checkpoint has no optimizer state)")
                      : from_masters < n    ? std::string(", the rest (without a master) from the weights")
                                            : std::string()));
    return out;
  }

 private:
  Result<ChosenTensor> Make(size_t weight) const {
    const FullTensor& w = all_[weight];
    ChosenTensor t{w.param, weight, w.dtype, w.dtype, w.shape, false};
    auto master = masters_.find(w.param);
    if (!options_.from_weights && master != masters_.end()) {
      const FullTensor& m = all_[master->second];
      if (ShapeNumel(m.shape) != ShapeNumel(w.shape)) {
        return Status::InvalidInput("the fp32 master of " + w.param + " has " +
                                    std::to_string(ShapeNumel(m.shape)) + " elements, the weight " +
                                    std::to_string(ShapeNumel(w.shape)));
      }
      t = {w.param, master->second, m.dtype, m.dtype, w.shape, true};
    }
    if (w.vocab) RESHARD_RETURN_IF_ERROR(StripVocab(&t));
    if (options_.dtype && IsFloatingPoint(t.dtype)) t.dtype = *options_.dtype;
    return t;
  }

  // Rows are the leading dimension, so the true rows are a prefix of the bytes.
  Status StripVocab(ChosenTensor* t) const {
    if (!options_.vocab_size) {
      return Status::InvalidInput(
          "the checkpoint does not record its true vocabulary size, so " + t->name +
          "'s padding rows cannot be stripped; pass --vocab-size N (the tokenizer's size) or give "
          "it with --set (docs/rules.md)");
    }
    if (*options_.vocab_size > t->shape[0]) {
      return Status::InvalidInput("--vocab-size " + std::to_string(*options_.vocab_size) + " exceeds the " +
                                  std::to_string(t->shape[0]) + " rows of " + t->name);
    }
    t->shape[0] = *options_.vocab_size;
    return Status::Ok();
  }

  const std::vector<FullTensor>& all_;
  const TensorChoiceOptions& options_;
  std::map<std::string, size_t> masters_;  // parameter -> its fp32 master
};

struct StateDictFile {
  std::string name;
  std::vector<StateDictTensor> tensors;
  int64_t bytes = 0;
  // Safetensors only: where everything lies, and the ranges its jobs write
  // (offsets from 0 to the file's size).
  SafetensorsLayout layout;
  std::vector<int64_t> cuts;
};

// Lays out each safetensors file and cuts it into ranges.
Status LayOut(std::vector<StateDictFile>* files) {
  for (StateDictFile& file : *files) {
    const std::vector<SafetensorsTensor> tensors = SafetensorsTensors(file.tensors, nullptr);
    RESHARD_ASSIGN_OR_RETURN(file.layout, LayOutSafetensors(tensors, kSafetensorsMetadata));
    file.cuts = SafetensorsCuts(file.layout, tensors, PartBytes(file.bytes));
  }
  return Status::Ok();
}

// Greedy, in order: a file takes tensors until the next would pass the size.
std::vector<StateDictFile> Shard(std::vector<StateDictTensor> tensors, int64_t max_bytes, bool torch_format) {
  std::vector<StateDictFile> files;
  for (StateDictTensor& t : tensors) {
    if (files.empty() || (files.back().bytes > 0 && files.back().bytes + t.size() > max_bytes)) {
      files.emplace_back();
    }
    files.back().bytes += t.size();
    files.back().tensors.push_back(std::move(t));
  }
  const char* stem = torch_format ? "pytorch_model" : "model";
  const char* ext = torch_format ? "bin" : "safetensors";
  for (size_t i = 0; i < files.size(); ++i) {
    char name[96];
    if (files.size() == 1) {
      std::snprintf(name, sizeof(name), "%s.%s", stem, ext);
    } else {
      std::snprintf(name, sizeof(name), "%s-%05zu-of-%05zu.%s", stem, i + 1, files.size(), ext);
    }
    files[i].name = name;
  }
  return files;
}

std::string IndexName(bool torch_format) {
  return torch_format ? "pytorch_model.bin.index.json" : "model.safetensors.index.json";
}

// {"metadata": {"total_size": N}, "weight_map": {name: file, ...}}, names sorted.
std::string IndexJson(const std::vector<StateDictFile>& files) {
  int64_t total = 0;
  std::map<std::string, std::string> weight_map;
  for (const StateDictFile& f : files) {
    total += f.bytes;
    for (const StateDictTensor& t : f.tensors) weight_map[t.name] = f.name;
  }
  std::string json = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) +
                     "\n  },\n  \"weight_map\": {\n";
  size_t i = 0;
  for (const auto& [name, file] : weight_map) {
    json += "    " + JsonString(name) + ": " + JsonString(file) + (++i < weight_map.size() ? ",\n" : "\n");
  }
  return json + "  }\n}\n";
}

// A safetensors file, written as byte ranges by several jobs.
PlannedFile SafetensorsFile(const StateDictFile& file, const std::vector<FullTensor>& sources) {
  auto content = std::make_shared<SafetensorsContent>();
  content->tensors = SafetensorsTensors(file.tensors, &sources);
  content->layout = file.layout;
  content->cuts = file.cuts;
  PlannedFile f;
  f.name = file.name;
  f.container = PlannedFile::Container::kSafetensors;
  if (file.cuts.size() > 2) f.what = "written as " + std::to_string(file.cuts.size() - 1) + " ranges";
  f.bytes = file.bytes;
  for (const StateDictTensor& t : file.tensors) f.tensors.push_back({t.name, t.dtype, t.shape, t.detail});
  f.safetensors = std::move(content);
  return f;
}

// A torch.save file: an OrderedDict of the tensors, as transformers saves it.
Result<PlannedFile> TorchFormatFile(const StateDictFile& file, const std::vector<FullTensor>& sources) {
  Items items;
  for (const StateDictTensor& t : file.tensors) {
    items.emplace_back(Value::String(t.name), MakeProducedTensor(t.dtype, t.shape, t.bytes(sources)));
  }
  RESHARD_ASSIGN_OR_RETURN(PlannedFile f, TorchFile(file.name, "", MakeOrderedDict(std::move(items))));
  for (const StateDictTensor& t : file.tensors) SetFrom(&f, t.name, t.detail);
  return f;
}

std::string Summary(const std::string& title, const std::vector<StateDictFile>& files) {
  int64_t tensors = 0, bytes = 0;
  for (const StateDictFile& f : files) {
    tensors += static_cast<int64_t>(f.tensors.size());
    bytes += f.bytes;
  }
  return title + ": " + Count(static_cast<int64_t>(files.size()), "tensor file") + ", " + Count(tensors, "tensor") +
         ", " + HumanBytes(bytes) + "\n";
}

}  // namespace

Result<std::vector<FullTensor>> WholeTensors(const SourceCheckpoint& src, ReplicatedPolicy replicated,
                                             std::optional<int64_t> vocab_size, std::vector<MissingValue> also,
                                             std::atomic<int64_t>* read) {
  std::vector<MissingValue> missing = src.MissingValues(std::nullopt, vocab_size);
  if (src.info().vocab_rows > 0 && !vocab_size && !src.info().vocab_size) {
    missing.push_back({"the true vocabulary size (the padding rows are stripped to it)", "--vocab-size N"});
  }
  missing.insert(missing.end(), std::make_move_iterator(also.begin()), std::make_move_iterator(also.end()));
  RESHARD_RETURN_IF_ERROR(CheckNoneMissing(missing));
  return src.FullTensors(replicated, read);
}

Result<std::vector<ChosenTensor>> ChooseTensors(const std::vector<FullTensor>& all, const std::string& kind,
                                                const TensorChoiceOptions& options,
                                                std::vector<std::string>* notes) {
  return TensorChoice(all, options).Choose(kind, notes);
}

std::vector<FormatOptionInfo> StateDictOptions(const std::string& from) {
  using Kind = FormatOptionInfo::Kind;
  return {{kFileFormat, Kind::kText, "Files: safetensors or pt (torch.save)", {"safetensors", "pt"}, false, "safetensors"},
          {kMaxShardSize, Kind::kCount, "Largest file, e.g. 5GB; a bigger tensor gets a file of its own", {}, true,
           "5000000000"},
          FromOption(from),
          DTypeOption()};
}

Result<std::optional<DType>> ExportDType(const std::string& name) {
  const std::map<std::string, DType> dtypes = {
      {"fp32", DType::kFloat32}, {"bf16", DType::kBFloat16}, {"fp16", DType::kFloat16}};
  if (name.empty()) return std::optional<DType>();
  auto it = dtypes.find(name);
  if (it == dtypes.end()) return Status::InvalidInput("unknown --dtype '" + name + "'; use fp32, bf16 or fp16");
  return std::optional<DType>(it->second);
}

ByteProducer CastBytes(ByteProducer from, DType src, DType dst) {
  return [from = std::move(from), src, dst](int64_t offset, int64_t length, uint8_t* out) {
    const int se = ElementSize(src), de = ElementSize(dst);
    if (offset % de != 0 || length % de != 0) {
      return Status::Internal("tensor bytes requested in a range not of whole elements");
    }
    const int64_t begin = offset / de, n = length / de;
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(static_cast<size_t>(n * se));
    RESHARD_RETURN_IF_ERROR(from(begin * se, n * se, scratch.data()));
    ConvertElements(src, scratch.data(), n, dst, out);
    return Status::Ok();
  };
}

ByteProducer ChosenBytes(const ChosenTensor& t, const std::vector<FullTensor>& sources) {
  const ByteProducer& produce = sources[t.source].produce;
  return t.dtype == t.source_dtype ? produce : CastBytes(produce, t.source_dtype, t.dtype);
}

int64_t StateDictTensor::size() const { return ShapeNumel(shape) * ElementSize(dtype); }

Result<OutputPlan> PlanStateDict(const SourceCheckpoint& src, StateDictLayout layout,
                                 std::vector<StateDictTensor> tensors, std::vector<SideFile> side) {
  std::vector<StateDictFile> files = Shard(std::move(tensors), layout.max_shard_size, layout.torch_format);
  if (!layout.torch_format) RESHARD_RETURN_IF_ERROR(LayOut(&files));
  OutputPlan plan;
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> sources, src.FullTensors(layout.replicated, plan.read.get()));
  plan.summary = Summary(layout.title, files);
  for (const StateDictFile& file : files) {
    if (!layout.torch_format) {
      plan.files.push_back(SafetensorsFile(file, sources));
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(PlannedFile f, TorchFormatFile(file, sources));
    plan.files.push_back(std::move(f));
  }
  if (files.size() > 1) plan.files.push_back(TextFile(IndexName(layout.torch_format), IndexJson(files)));
  for (SideFile& f : side) {
    plan.files.push_back(f.copy_of.empty() ? TextFile(f.name, std::move(f.text))
                                           : CopiedFile(f.name, std::move(f.copy_of), false));
  }
  plan.scratch_bytes = layout.scratch_bytes;
  plan.scratch = std::move(layout.scratch);
  return plan;
}

}  // namespace reshard
