#include "formats/consolidated/consolidated_export.h"

#include "formats/state_dict.h"

namespace reshard {
namespace {

ConsolidatedOptions ConsolidatedOptionsFrom(const ExportOptions& options, std::optional<DType> dtype) {
  ConsolidatedOptions out;
  out.replicated = options.replicated;
  out.from_weights = options.weights_only || FormatOption(options, "from") == "weights";
  out.vocab_size = options.vocab_size;
  out.max_shard_size = FormatCount(options, kMaxShardSize);
  out.torch_format = FormatOption(options, kFileFormat) == "pt";
  out.dtype = dtype;
  return out;
}

}  // namespace

TargetFormat ConsolidatedTarget() {
  TargetFormatInfo info{"consolidated", "one state dict of whole tensors under their canonical names",
                        "the folder to write (new, or empty)"};
  info.options = StateDictOptions("masters");
  return {std::move(info), [](const SourceCheckpoint& src, const ExportOptions& options,
                              std::vector<std::string>* notes) -> Result<OutputPlan> {
            RESHARD_ASSIGN_OR_RETURN(std::optional<DType> dtype, ExportDType(FormatOption(options, "dtype")));
            return PlanConsolidated(src, ConsolidatedOptionsFrom(options, dtype), notes);
          }};
}

Result<OutputPlan> PlanConsolidated(const SourceCheckpoint& src,
                                                     const ConsolidatedOptions& options,
                                                     std::vector<std::string>* notes) {
  TensorChoiceOptions choice{"consolidated", "--weights-only", options.from_weights, options.dtype,
                             options.vocab_size ? options.vocab_size : src.info().vocab_size};
  std::atomic<int64_t> unused{0};  // planning reads no tensor bytes
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> all,
                           WholeTensors(src, options.replicated, options.vocab_size, {}, &unused));
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
