// State dicts of whole tensors, what the consolidated and HF exports write:
// the choice of each parameter's source tensor (fp32 master or weight,
// vocabulary padding stripped, cast to the asked dtype), and the files —
// model.safetensors, or model-0000K-of-0000N.safetensors with
// model.safetensors.index.json past the shard size, or the same as
// pytorch_model*.bin (torch.save) — each streamed by its jobs, plus small
// text files beside them (an HF config.json) and copied files.
//
// It sits in formats/ itself, beside format.h, because two format folders
// share it and may not include each other.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "container/scratch_file.h"
#include "formats/format.h"

namespace reshard {

// How each exported parameter is chosen among a source's FullTensors.
struct TensorChoiceOptions {
  std::string what;                   // the export, in notes and messages: "consolidated", "hf"
  std::string weights_flag;           // what asks for the weights, for messages: "--weights-only"
  bool from_weights = false;          // the weights even where there are masters
  std::optional<DType> dtype;         // floating tensors cast to it; unset = as stored
  std::optional<int64_t> vocab_size;  // true vocabulary rows; unset = refused if a tensor needs it
};

// One parameter of an export and the source tensor it is made from.
struct ChosenTensor {
  std::string name;   // the parameter's canonical name
  size_t source = 0;  // index into the source's FullTensors
  DType source_dtype = DType::kFloat32;
  DType dtype = DType::kFloat32;  // as written
  std::vector<int64_t> shape;     // as written: vocabulary padding stripped
  bool master = false;            // made from the fp32 master
};

// The source's FullTensors for an export of whole tensors, or one refusal
// naming every value the export lacks: those reading the tensors needs, the
// true vocabulary size its padding rows are stripped to (`vocab_size`, else
// the source's), and the target's own (`also`).
Result<std::vector<FullTensor>> WholeTensors(const SourceCheckpoint& src, ReplicatedPolicy replicated,
                                             std::optional<int64_t> vocab_size, std::vector<MissingValue> also,
                                             std::atomic<int64_t>* read);

// Every parameter once, in the source's order, with a note saying how many
// come from the fp32 masters.
Result<std::vector<ChosenTensor>> ChooseTensors(const std::vector<FullTensor>& all, const std::string& kind,
                                                const TensorChoiceOptions& options,
                                                std::vector<std::string>* notes);

// The options every target writing a state dict declares: kFileFormat
// (safetensors or pt, torch.save), kMaxShardSize (bytes per file; a bigger
// tensor gets a file of its own), --from (`from` by default) and --dtype.
inline constexpr char kFileFormat[] = "format";
inline constexpr char kMaxShardSize[] = "max-shard-size";
std::vector<FormatOptionInfo> StateDictOptions(const std::string& from);

// The dtype `--dtype` names: fp32, bf16, fp16, or "" (nullopt: as stored).
Result<std::optional<DType>> ExportDType(const std::string& name);

// The bytes of `from` (elements of `src`) as elements of `dst`.
ByteProducer CastBytes(ByteProducer from, DType src, DType dst);

// The bytes of `t`: its source's (the vocabulary rows are a prefix), cast.
ByteProducer ChosenBytes(const ChosenTensor& t, const std::vector<FullTensor>& sources);

// One tensor of the files, made from the source's FullTensors when its file
// is written.
struct StateDictTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string detail;  // for `--dry-run`: where it comes from
  std::function<ByteProducer(const std::vector<FullTensor>&)> bytes;

  int64_t size() const;
};

// A file written beside the tensors: `text`, or a copy of the file `copy_of`.
struct SideFile {
  std::string name;
  std::string text;
  std::string copy_of;
};

struct StateDictLayout {
  std::string title;           // the plan's first word: "consolidated", "hf"
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  int64_t max_shard_size = 0;  // bytes per file; a bigger tensor gets its own
  bool torch_format = false;   // pytorch_model*.bin instead of safetensors
  // Bytes a job holds beyond its buffer while it writes (a transpose's
  // pieces), counted against --max-memory.
  int64_t scratch_bytes = 0;
  // Where tensors that need a scratch file make it: the jobs name the folder
  // they write into as they start. Unset when none does.
  std::shared_ptr<ScratchFolder> scratch = nullptr;
};

// Plans the files: tensors in order, cut greedily at the shard size, then the
// index (when there are several files) and the side files. A safetensors
// file is written as byte ranges, so that several workers share a big one.
// `src` must outlive the plan and its jobs.
Result<OutputPlan> PlanStateDict(const SourceCheckpoint& src, StateDictLayout layout,
                                                  std::vector<StateDictTensor> tensors, std::vector<SideFile> side);

}  // namespace reshard
