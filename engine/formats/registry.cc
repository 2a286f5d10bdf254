#include "formats/registry.h"

#include <filesystem>

#include "container/record_crc.h"
#include "formats/accelerate/accelerate_import.h"
#include "formats/consolidated/consolidated_source.h"
#include "formats/dcp/dcp_source.h"
#include "formats/dcp_recipe/dcp_recipe_import.h"
#include "formats/dcp_common/megatron_tracker.h"
#include "formats/deepspeed/deepspeed_source.h"
#include "formats/folder_hint.h"
#include "formats/hf_common/hf_folder.h"
#include "formats/hf_common/hf_import.h"
#include "formats/hf_common/hf_rules.h"
#include "formats/imported/imported_source.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "formats/megatron_core/torch/megatron_torch_import.h"
#include "formats/megatron_core/torch_dist/torch_dist_import.h"
#include "formats/torchtitan/torchtitan_import.h"
#include "logical/settings.h"

namespace reshard {

namespace {

// `--rules none`: a DCP folder read as it is, even where a rule set reads it.
constexpr char kNoRules[] = "none";

// `opened`, named as read by `format`, saved at `tp` x `pp` x `dp` (and
// `ep`, its experts') where known.
Result<std::unique_ptr<SourceCheckpoint>> Named(const std::string& format,
                                                Result<std::unique_ptr<SourceCheckpoint>> opened, int tp = 0,
                                                int pp = 0, int dp = 0, int ep = 0) {
  if (opened.ok()) (*opened)->SetOrigin(format, tp, pp, dp, ep);
  return opened;
}

// A model another format read, as a source of its own; DeepSpeed's targets
// lay it out in DeepSpeed's files.
std::unique_ptr<SourceCheckpoint> Imported(ImportedModel model, const CommonOptions& options) {
  return MakeModelSource(std::move(model), options, MakeImportedSource);
}

// `opened`, saved as whole tensors: an HF folder or a state dict.
Result<std::unique_ptr<SourceCheckpoint>> SavedWhole(Result<std::unique_ptr<SourceCheckpoint>> opened) {
  if (opened.ok()) (*opened)->SetSavedWhole();
  return opened;
}

// Every tensor of `content` whole, as runs of its chunks, and its objects.
DcpTensors TensorsOf(const DcpContent& content) {
  DcpTensors out{content.folder, content.Paths(), {}, content.bytes_items,
                 [&content](const std::string& key) { return content.ReadBytes(key); }, {},
                 WritingRanks(content.folder)};
  for (const DcpTensor& t : content.tensors) {
    auto unread = [fqn = t.fqn](int64_t, int64_t, uint8_t*) {
      return Status::Internal(fqn + " is read through its runs, not its placeholder tensor");
    };
    out.tensors[t.fqn] = ImportedTensor{MakeProducedTensor(t.dtype, t.size, unread), SliceRuns(t, -1)};
    out.chunks[t.fqn] = content.meta.items.at(t.fqn).chunks;
  }
  return out;
}

// The source `imported` read from `folder`, named as read by `format`, with
// the layout it was saved at.
Result<std::unique_ptr<SourceCheckpoint>> FromStateDict(const std::string& format, StateDictImport imported,
                                                        const std::string& folder, const CommonOptions& options) {
  const int tp = imported.tp, pp = imported.pp, dp = imported.dp;
  return Named(format,
               Imported({std::move(imported.logical), folder, std::move(imported.what),
                                   std::move(imported.files), std::move(imported.notes),
                                   std::move(imported.optimizer), imported.optimizer_status, "",
                                   std::move(imported.facts)},
                                  options),
               tp, pp, dp);
}

// `imported` as format `format`'s pipeline model; when it is a refusal, the
// DCP folder as what it is with the reason (the refusal itself where the user
// asked for a reading: --rules, --state-dict-prefixes).
Result<std::unique_ptr<SourceCheckpoint>> OpenStateDict(const std::string& format, DcpContent content,
                                                        Result<StateDictImport> imported, bool asked,
                                                        const CommonOptions& options) {
  if (!imported.ok()) {
    if (asked) return imported.status();
    return Named("dcp", OpenDcpCheckpoint(std::move(content), imported.status().message()));
  }
  return FromStateDict(format, std::move(*imported), content.folder, options);
}

// A DCP folder of torchtitan's model, or of a model and its optimizer saved
// by PyTorch's DCP recipe, read as its family's pipeline model; any other, or
// one no family reads, as what it is.
Result<std::unique_ptr<SourceCheckpoint>> OpenModelStateDict(DcpContent content, const CommonOptions& options) {
  const DcpTensors tensors = TensorsOf(content);
  const bool asked = !options.rules.empty() || !options.state_dict_prefixes.empty();
  if (options.state_dict_prefixes.empty() && LooksLikeTorchtitan(tensors, options.rules)) {
    Result<StateDictImport> imported = ReadTorchtitanImport(tensors, options);
    return OpenStateDict("torchtitan", std::move(content), std::move(imported), asked, options);
  }
  // A folder whose structure is the recipe's but ambiguous is refused, naming the option.
  RESHARD_ASSIGN_OR_RETURN(std::optional<RecipePrefixes> recipe,
                           FindRecipePrefixes(tensors, options.state_dict_prefixes, options.rules));
  if (!recipe) return Named("dcp", OpenDcpCheckpoint(std::move(content), ""));
  Result<StateDictImport> imported = ReadDcpRecipeImport(tensors, *recipe, options);
  Result<std::unique_ptr<SourceCheckpoint>> opened =
      OpenStateDict("dcp_recipe", std::move(content), std::move(imported), asked, options);
  if (opened.ok() && (*opened)->info().format == "dcp_recipe") {
    (*opened)->SetFormatOptions(RecipeSaveOptions(tensors, *recipe));
  }
  return opened;
}

// An Accelerate FSDP checkpoint: its model's and its optimizer's DCP folders
// read as one state dict.
Result<std::unique_ptr<SourceCheckpoint>> OpenAccelerate(const std::string& folder, const CommonOptions& options) {
  if (IsAccelerateFullStateDict(folder)) {  // torch.save files, every tensor whole
    RESHARD_ASSIGN_OR_RETURN(const DcpTensors tensors, ReadAccelerateFullStateDict(folder));
    RESHARD_ASSIGN_OR_RETURN(StateDictImport imported, ReadAccelerateImport(tensors, options));
    Result<std::unique_ptr<SourceCheckpoint>> opened =
        SavedWhole(FromStateDict("accelerate", std::move(imported), folder, options));
    if (opened.ok()) (*opened)->SetFormatOptions(AccelerateSaveOptions(tensors));
    return opened;
  }
  RESHARD_ASSIGN_OR_RETURN(const DcpContent model, ReadDcpContent(folder + "/" + kAccelerateModelFolder));
  DcpTensors tensors = TensorsOf(model);
  tensors.folder = folder;
  std::optional<DcpContent> optimizer;
  std::error_code ec;
  if (std::filesystem::is_directory(folder + "/" + kAccelerateOptimizerFolder, ec)) {
    RESHARD_ASSIGN_OR_RETURN(optimizer, ReadDcpContent(folder + "/" + kAccelerateOptimizerFolder));
    DcpTensors more = TensorsOf(*optimizer);
    tensors.files.insert(tensors.files.end(), more.files.begin(), more.files.end());
    tensors.tensors.merge(more.tensors);
    tensors.chunks.merge(more.chunks);
    tensors.objects.insert(tensors.objects.end(), more.objects.begin(), more.objects.end());
    tensors.read_object = [&model, &optimizer](const std::string& key) {
      return model.meta.Find(key, {}) != nullptr ? model.ReadBytes(key) : optimizer->ReadBytes(key);
    };
  }
  RESHARD_ASSIGN_OR_RETURN(StateDictImport imported, ReadAccelerateImport(tensors, options));
  Result<std::unique_ptr<SourceCheckpoint>> opened = FromStateDict("accelerate", std::move(imported), folder, options);
  if (opened.ok()) (*opened)->SetFormatOptions(AccelerateSaveOptions(tensors));
  return opened;
}

// A Megatron-Core torch_dist folder is read as the pipeline model its
// family's rules describe; any other DCP folder, or one no built-in rule set
// reads, as what it is.
Result<std::unique_ptr<SourceCheckpoint>> OpenDcp(const std::string& folder, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(DcpContent content, ReadDcpContent(folder));
  if (options.rules == kNoRules) return Named("dcp", OpenDcpCheckpoint(std::move(content), ""));
  if (!content.torch_dist) return OpenModelStateDict(std::move(content), options);
  Result<TorchDistImport> imported = ReadTorchDistImport(content, options);
  if (!imported.ok()) {
    // Read as it is, the folder would take none of the values the user gave with --set.
    const bool asked = !options.rules.empty() || !options.set.empty();
    if (asked || imported.status().code() != Status::Code::kUnsupported) return imported.status();
    return Named("dcp", OpenDcpCheckpoint(std::move(content), imported.status().message()));
  }
  const int tp = imported->tp, pp = imported->pp, dp = imported->dp, ep = imported->ep;
  return Named("torch_dist",
               Imported({std::move(imported->logical), folder, std::move(imported->what),
                                   std::move(imported->files), std::move(imported->notes),
                                   std::move(imported->optimizer), imported->optimizer_status,
                                   std::move(imported->megatron_core_version), std::move(imported->facts)},
                                  options),
               tp, pp, dp, ep);
}

// Where `args.<field>` comes from in an HF folder: "config.json's
// rope_scaling; " when an hf.config case sets it, "" when nothing does.
std::string HfFieldSetting(const RuleSet& rules, const std::string& field) {
  if (rules.section<HfExport>() == nullptr) return "";
  for (const HfConfigField& f : rules.section<HfExport>()->config) {
    for (const HfConfigField::Case& c : f.cases) {
      if (c.when.count(field)) return "config.json's " + f.key + "; ";
    }
  }
  return rules.section<HfExport>()->requirements.count(field) ? "what " + rules.section<HfExport>()->architecture + " computes; " : "";
}

}  // namespace

Status CheckPipelineComputes(const SourceCheckpoint& src) {
  const RuleSet* rules = src.info().rules.get();
  if (rules == nullptr) return Status::Ok();
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  for (const auto& [field, expected] : rules->pipeline_requirements()) {
    if (ArgHolds(inputs, field, expected)) continue;
    const std::string mismatch = ArgsMismatch(inputs, {{field, expected}});
    return Status::Unsupported("the Megatron-DeepSpeed model of rule set " + rules->name() + " does not compute "
                               "this one: " + mismatch + " (" + HfFieldSetting(*rules, field) + "pipeline.requires of " +
                               rules->origin() + ")" +
                               (rules->section<TorchDistLayout>() ? "; export --to torch_dist writes it for Megatron-Core, which does"
                                                    : ""));
  }
  return Status::Ok();
}

Result<std::unique_ptr<SourceCheckpoint>> OpenCheckpoint(const std::string& path,
                                                         const CommonOptions& options) {
  SetRecordCrcChecks(options.check_crc);
  // A Megatron-LM root's tracker that names no folder is refused by name,
  // not taken for another format's folder, with the folder to pass instead.
  if (Status tracker = MegatronTrackedFolder(path).status(); !tracker.ok()) {
    Result<std::string> inside = CheckpointInsideRoot(path);
    return inside.ok() ? tracker : inside.status();
  }
  // A new format recognises its own folders here, before DeepSpeed's
  // refusal of the rest. An HF folder is read as the pipeline model its
  // family's rules describe, which converts into DeepSpeed's layout.
  if (IsHfFolder(path)) {
    RESHARD_ASSIGN_OR_RETURN(HfImport hf, ReadHfImport(path, options));
    return SavedWhole(Named("hf", Imported({std::move(hf.logical), path, std::move(hf.what),
                                                     std::move(hf.files), std::move(hf.notes), std::nullopt,
                                                     Status::Ok(), "", std::move(hf.facts),
                                                     /*records_iteration=*/false},
                                                    options)));
  }
  RESHARD_ASSIGN_OR_RETURN(const std::string accelerate, AccelerateCheckpointFolder(path));
  if (!accelerate.empty()) return OpenAccelerate(accelerate, options);
  if (const std::string mlm = MegatronTorchFolder(path); !mlm.empty()) {
    RESHARD_ASSIGN_OR_RETURN(MegatronTorchImport imported, ReadMegatronTorchImport(mlm, options));
    return Named("megatron", Imported({std::move(imported.logical), mlm, std::move(imported.what),
                                                 std::move(imported.files), std::move(imported.notes),
                                                 std::move(imported.optimizer), imported.optimizer_status,
                                                 "", std::move(imported.facts)},
                                                options),
                 imported.tp, imported.pp, imported.dp);
  }
  if (const std::string dcp = DcpCheckpointFolder(path); !dcp.empty()) return OpenDcp(dcp, options);
  if (IsWeightsWithoutConfig(path)) return SavedWhole(Named("state dict", OpenWeightsWithoutConfig(path)));
  // A root holding one checkpoint folder is read as it; one holding several is refused naming them.
  RESHARD_ASSIGN_OR_RETURN(const std::string inside, CheckpointInsideRoot(path));
  if (!inside.empty()) return OpenCheckpoint(inside, options);
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(path));
  return Named("deepspeed", OpenDeepSpeedCheckpoint(std::move(files), options));
}

std::string CheckpointFolder(const std::string& path) {
  if (Result<std::string> accelerate = AccelerateCheckpointFolder(path); accelerate.ok() && !accelerate->empty()) {
    return *accelerate;
  }
  if (const std::string mlm = MegatronTorchFolder(path); !mlm.empty()) return mlm;
  if (const std::string dcp = DcpCheckpointFolder(path); !dcp.empty()) return dcp;
  if (Result<std::string> inside = CheckpointInsideRoot(path); inside.ok() && !inside->empty()) return *inside;
  return FollowLatest(path);
}

}  // namespace reshard
