#include "formats/consolidated/consolidated_export.h"

#include "formats/state_dict.h"

namespace reshard {

Result<ConsolidatedOptions> ConsolidatedOptionsFrom(const ExportOptions& options) {
  ConsolidatedOptions out;
  out.replicated = options.replicated;
  out.from_weights = options.weights_only || options.from == "weights";
  out.vocab_size = options.vocab_size;
  out.max_shard_size = options.max_shard_size;
  if (out.max_shard_size < 1) return Status::InvalidInput("--max-shard-size must be at least 1 byte");
  if (options.file_format != "safetensors" && options.file_format != "pt") {
    return Status::InvalidInput("unknown --format '" + options.file_format + "'; use safetensors or pt");
  }
  out.torch_format = options.file_format == "pt";
  RESHARD_ASSIGN_OR_RETURN(out.dtype, ExportDType(options.dtype));
  return out;
}

Result<OutputPlan> PlanConsolidated(const SourceCheckpoint& src,
                                                     const ConsolidatedOptions& options,
                                                     std::vector<std::string>* notes) {
  TensorChoiceOptions choice{"consolidated", "--weights-only", options.from_weights, options.dtype,
                             options.vocab_size ? options.vocab_size : src.info().vocab_size};
  std::atomic<int64_t> unused{0};  // planning reads no tensor bytes
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all, src.FullTensors(options.replicated, &unused));
  RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> chosen, ChooseTensors(all, src.info().kind, choice, notes));
  std::vector<StateDictTensor> tensors;
  for (const ChosenTensor& t : chosen) {
    tensors.push_back({t.name, t.dtype, t.shape, t.master ? "fp32 master" : "weights",
                       [t](const std::vector<FullTensor>& sources) { return ChosenBytes(t, sources); }});
  }
  StateDictLayout layout{"consolidated", options.replicated, options.max_shard_size, options.torch_format};
  return PlanStateDict(src, std::move(layout), std::move(tensors), {});
}

}  // namespace reshard
