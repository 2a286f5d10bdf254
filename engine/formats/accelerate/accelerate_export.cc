#include "formats/accelerate/accelerate_export.h"

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/accelerate/accelerate_import.h"
#include "formats/fsdp2_dcp.h"
#include "formats/hf_common/hf_mapping.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kAccelerate[] = "accelerate";

// The Trainer's run state: an Accelerate source's files copied (at another
// world size all but the ranks' RNG states, each a rank's of the save's
// world); without its trainer_state.json, one holding the source's step as
// global_step, which the Trainer resumes from (its other fields take
// TrainerState's defaults).
void AddRunState(const SourceCheckpoint& src, int64_t ranks, OutputPlan* out, std::vector<std::string>* notes) {
  std::vector<std::string> carried, left;
  bool trainer_state = false;
  if (src.info().format == kAccelerate) {
    for (const std::string& name : AccelerateRunFiles(src.info().tag_dir)) {
      const std::string path = src.info().tag_dir + "/" + name;
      std::error_code ec;
      if ((IsRankRngState(name) && src.info().dp != ranks) || !std::filesystem::is_regular_file(path, ec)) {
        left.push_back(name);
        continue;
      }
      out->files.push_back(CopiedFile(name, path, false));
      carried.push_back(name);
      trainer_state = trainer_state || name == kTrainerStateFile;
    }
  }
  if (!trainer_state) {
    out->files.push_back(TextFile(kTrainerStateFile,
                                  "{\"global_step\": " + std::to_string(src.info().iteration) + "}\n"));
    notes->push_back(std::string("accelerate: ") + kTrainerStateFile + " holds only the step (global_step " +
                     std::to_string(src.info().iteration) + "); the source records no more of the Trainer's state");
  }
  if (!carried.empty()) notes->push_back("accelerate: copied the source's " + Join(carried, ", "));
  if (!left.empty()) {
    notes->push_back("accelerate: not copied: " + Join(left, ", ") + " (a rank's RNG state at the save's world "
                     "size, or a folder); the Trainer starts a rank without one from its seed");
  }
}

// The param groups of an optimizer state keyed by index (--fsdp-version 2),
// each its parameters' FQNs in index order: an Accelerate FSDP2 source's
// own, the one place the order of the module's parameters is recorded.
Result<std::vector<std::vector<std::string>>> IndexGroups(const SourceCheckpoint& src) {
  std::optional<AccelerateParamIndex> index;
  if (src.info().format == kAccelerate) {
    RESHARD_ASSIGN_OR_RETURN(index, ReadAccelerateParamIndex(src.info().tag_dir));
  }
  if (!index) {
    return Status::Unsupported(std::string("export --to accelerate --") + kFsdpVersionOption + " 2 keys the "
                               "optimizer state by parameter index, the order of the module's parameters, which "
                               "only an Accelerate FSDP2 save records; write --" + kFsdpVersionOption + " 1, or "
                               "add --weights-only");
  }
  std::vector<std::vector<std::string>> groups;
  for (const std::vector<int64_t>& group : index->groups) {
    groups.emplace_back();
    for (int64_t i : group) groups.back().push_back(index->fqns[i]);
  }
  return groups;
}

Result<OutputPlan> PlanAccelerate(const SourceCheckpoint& src, const ExportOptions& options,
                                  std::vector<std::string>* notes) {
  const int64_t ranks = FormatCount(options, kDpShardOption);
  if (ranks < 1) {
    return Status::InvalidInput("export --to accelerate needs --dp-shard N (>= 1), the FSDP world size the "
                                "parameters are sharded over");
  }
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(Fsdp2Source read, ReadFsdp2Source(src, inputs, options, kAccelerate, &out, notes));
  const Fsdp2Mesh mesh{static_cast<int>(ranks), 1};
  Fsdp2Files model_files(mesh), optim_files(mesh);
  Fsdp2StateDictWriter writer(StateDictPrefix::Of({"model"}), StateDictPrefix::Of({"optimizer"}),
                              /*flat_groups=*/false, &model_files, &optim_files);
  const bool by_index = FormatOption(options, kFsdpVersionOption) == "2";
  if (by_index && read.optimizer) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<std::vector<std::string>> groups, IndexGroups(src));
    writer.KeyByIndex(std::move(groups));
  }
  RESHARD_ASSIGN_OR_RETURN(const int model_tensors, writer.AddModel(read, inputs, &out));
  if (read.optimizer) RESHARD_RETURN_IF_ERROR(writer.AddOptimizer(src, read, inputs, kAccelerate, &out, notes));
  RESHARD_RETURN_IF_ERROR(model_files.AddTo(kAccelerateModelFolder, &out));
  if (read.optimizer) RESHARD_RETURN_IF_ERROR(optim_files.AddTo(kAccelerateOptimizerFolder, &out));
  std::vector<std::string> left_out;
  RESHARD_ASSIGN_OR_RETURN(std::string config, RecordedConfigJson(*read.hf, inputs, read.params, read.all, &left_out));
  out.files.push_back(TextFile("config.json", std::move(config)));
  out.summary = "accelerate: SHARDED_STATE_DICT (fsdp_version " + FormatOption(options, kFsdpVersionOption) +
                ") over " + Count(ranks, "rank") + "; " +
                Count(model_tensors, "model tensor") + " in " + kAccelerateModelFolder +
                (read.optimizer ? std::string("; AdamW state in ") + kAccelerateOptimizerFolder +
                                      (by_index ? " by parameter index" : " by FQN") +
                                      " (exp_avg, exp_avg_sq, step, param_groups)"
                                : std::string("; weights only")) +
                "\n";
  AddRunState(src, ranks, &out, notes);
  if (!left_out.empty()) {
    notes->push_back("accelerate: config.json leaves out " + Join(left_out, ", ") + ", which the source does not record");
  }
  return out;
}

}  // namespace

TargetFormat AccelerateTarget() {
  TargetFormatInfo info{kAccelerate,
                        "a Hugging Face Trainer / Accelerate FSDP checkpoint (SHARDED_STATE_DICT): the model's and "
                        "its AdamW state's DCP folders, over --dp-shard ranks",
                        "the checkpoint-N folder itself"};
  info.options = {DpShardOption(),
                  {kFsdpVersionOption, FormatOptionInfo::Kind::kText,
                   "The FSDP version whose optimizer state dict is written, as Accelerate's load_fsdp_optimizer "
                   "reads it: 1, FSDP.optim_state_dict keyed by FQN; 2, the optimizer's own state_dict() keyed by "
                   "parameter index (in an Accelerate FSDP2 source's order); an Accelerate source's own by default",
                   {"1", "2"}, false, "1"},
                  FromOption("masters"), DTypeOption()};
  return {std::move(info), PlanAccelerate};
}

}  // namespace reshard
