#include "formats/format.h"

#include "container/record_crc.h"
#include "formats/consolidated/consolidated_export.h"
#include "formats/dcp/dcp_source.h"
#include "formats/dcp/torch_dist_import.h"
#include "formats/deepspeed/deepspeed_source.h"
#include "formats/hf/hf_export.h"
#include "formats/hf/hf_folder.h"
#include "formats/hf/hf_import.h"
#include "formats/hf/torchtitan_export.h"
#include "formats/hf/torchtitan_import.h"
#include "formats/megatron/megatron_export.h"
#include "formats/megatron/megatron_torch_import.h"
#include "formats/megatron/torch_dist_export.h"
#include "logical/settings.h"
#include "logical/torch_dist_family.h"

namespace reshard {

namespace {

// `--rules none`: a DCP folder read as it is, even where a rule set reads it.
constexpr char kNoRules[] = "none";

// A Megatron-Core torch_dist folder is read as the pipeline model its
// family's rules describe; any other DCP folder, or one no built-in rule set
// reads, as what it is.
// Every tensor of `content` whole, as runs of its chunks, and its objects.
DcpTensors TensorsOf(const DcpContent& content) {
  DcpTensors out{content.folder, content.Paths(), {}, content.bytes_items,
                 [&content](const std::string& key) { return content.ReadBytes(key); }};
  for (const DcpTensor& t : content.tensors) {
    auto unread = [fqn = t.fqn](int64_t, int64_t, uint8_t*) {
      return Status::Internal(fqn + " is read through its runs, not its placeholder tensor");
    };
    out.tensors[t.fqn] = ImportedTensor{MakeProducedTensor(t.dtype, t.size, unread), SliceRuns(t, -1)};
  }
  return out;
}

// A DCP folder of torchtitan's model, read as its family's pipeline model;
// any other, or one no family reads, as what it is.
Result<std::unique_ptr<SourceCheckpoint>> OpenTorchtitan(DcpContent content, const CommonOptions& options) {
  const DcpTensors tensors = TensorsOf(content);
  if (!LooksLikeTorchtitan(tensors, options.rules)) return OpenDcpCheckpoint(std::move(content), "");
  Result<TorchtitanImport> imported = ReadTorchtitanImport(tensors, options);
  if (!imported.ok()) {
    if (!options.rules.empty()) return imported.status();
    return OpenDcpCheckpoint(std::move(content), imported.status().message());
  }
  return MakeImportedSource({std::move(imported->logical), content.folder, std::move(imported->what),
                             std::move(imported->files), std::move(imported->notes), std::move(imported->optimizer),
                             imported->optimizer_status},
                            options);
}

Result<std::unique_ptr<SourceCheckpoint>> OpenDcp(const std::string& folder, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(DcpContent content, ReadDcpContent(folder));
  if (options.rules == kNoRules) return OpenDcpCheckpoint(std::move(content), "");
  if (!content.torch_dist) return OpenTorchtitan(std::move(content), options);
  Result<TorchDistImport> imported = ReadTorchDistImport(content, options);
  if (!imported.ok()) {
    if (!options.rules.empty() || imported.status().code() != Status::Code::kUnsupported) return imported.status();
    return OpenDcpCheckpoint(std::move(content), imported.status().message());
  }
  return MakeImportedSource({std::move(imported->logical), folder, std::move(imported->what),
                             std::move(imported->files), std::move(imported->notes), std::move(imported->optimizer),
                             imported->optimizer_status, std::move(imported->megatron_core_version)},
                            options);
}

// Where `args.<field>` comes from in an HF folder: "config.json's
// rope_scaling; " when an hf.config case sets it, "" when nothing does.
std::string HfFieldSetting(const RuleSet& rules, const std::string& field) {
  if (rules.hf() == nullptr) return "";
  for (const HfConfigField& f : rules.hf()->config) {
    for (const HfConfigField::Case& c : f.cases) {
      if (c.when.count(field)) return "config.json's " + f.key + "; ";
    }
  }
  return rules.hf()->requirements.count(field) ? "what " + rules.hf()->architecture + " computes; " : "";
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
                               (rules->torch_dist() ? "; export --to torch_dist writes it for Megatron-Core, which does"
                                                    : ""));
  }
  return Status::Ok();
}

Result<std::unique_ptr<SourceCheckpoint>> OpenCheckpoint(const std::string& path,
                                                         const CommonOptions& options) {
  SetRecordCrcChecks(options.check_crc);
  // A Megatron-LM root's tracker that names no folder is refused by name,
  // not taken for another format's folder.
  RESHARD_RETURN_IF_ERROR(MegatronTrackedFolder(path).status());
  // A new format recognises its own folders here, before DeepSpeed's
  // refusal of the rest. An HF folder is read as the pipeline model its
  // family's rules describe, which converts into DeepSpeed's layout.
  if (IsHfFolder(path)) {
    RESHARD_ASSIGN_OR_RETURN(HfImport hf, ReadHfImport(path, options));
    return MakeImportedSource({std::move(hf.logical), path, std::move(hf.what), std::move(hf.files), std::move(hf.notes),
                               std::nullopt, Status::Ok()},
                              options);
  }
  if (const std::string mlm = MegatronTorchFolder(path); !mlm.empty()) {
    RESHARD_ASSIGN_OR_RETURN(MegatronTorchImport imported, ReadMegatronTorchImport(mlm, options));
    return MakeImportedSource({std::move(imported.logical), mlm, std::move(imported.what), std::move(imported.files),
                               std::move(imported.notes), std::move(imported.optimizer), imported.optimizer_status},
                              options);
  }
  if (const std::string dcp = DcpCheckpointFolder(path); !dcp.empty()) return OpenDcp(dcp, options);
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles files, ScanCheckpoint(path));
  return OpenDeepSpeedCheckpoint(std::move(files), options);
}

std::string CheckpointFolder(const std::string& path) {
  if (const std::string mlm = MegatronTorchFolder(path); !mlm.empty()) return mlm;
  const std::string dcp = DcpCheckpointFolder(path);
  return dcp.empty() ? FollowLatest(path) : dcp;
}

Result<OutputPlan> PlanExport(const SourceCheckpoint& src, const ExportOptions& options,
                                               std::vector<std::string>* notes) {
  if (!options.optimizer_layout.empty() && options.to != "torch_dist") {
    return Status::InvalidInput("--optimizer-layout lays out the optimizer state of --to torch_dist; the " + options.to +
                                " export has none of its own, so leave it out");
  }
  if ((!options.megatron_core_version.empty() || options.ddp_bucket_size != 0) && options.to != "torch_dist") {
    return Status::InvalidInput(std::string(options.ddp_bucket_size != 0 ? "--ddp-bucket-size" : "--megatron-core-version") +
                                " chooses the form of --to torch_dist; leave it out of --to " + options.to);
  }
  if (options.dp_shard != 0 && options.to != "torchtitan") {
    return Status::InvalidInput("--dp-shard chooses the FSDP2 sharding of --to torchtitan; the " + options.to +
                                " export has none, so leave it out");
  }
  if (options.to == "megatron") return PlanMegatron(src, options, notes);
  if (!options.layer_spec.empty()) {
    return Status::InvalidInput("--layer-spec chooses the keys of --to megatron; leave it out of --to " + options.to);
  }
  if (options.to == "torch_dist") return PlanTorchDist(src, options, notes);
  if (options.dp != 0) {
    return Status::InvalidInput("--dp lays out the optimizer state of --to torch_dist; the " + options.to +
                                " export has no data-parallel layout, so leave it out");
  }
  if (options.to == "torchtitan") return PlanTorchtitan(src, options, notes);
  if (options.tp != 0 || options.pp != 0) {
    return Status::InvalidInput("--tp and --pp choose the layout of --to megatron and --to torch_dist; the " +
                                options.to + " export has none, so leave them out");
  }
  if (options.to == "universal") {
    RESHARD_RETURN_IF_ERROR(CheckPipelineComputes(src));
    return src.PlanFamilyFormat(options, notes);
  }
  if (options.to == "hf") return PlanHf(src, options, notes);
  if (options.to != "consolidated") {
    return Status::InvalidInput("unknown export format '" + options.to + "'; use consolidated, hf, megatron, torch_dist, torchtitan or universal");
  }
  RESHARD_ASSIGN_OR_RETURN(ConsolidatedOptions consolidated, ConsolidatedOptionsFrom(options));
  return PlanConsolidated(src, consolidated, notes);
}

}  // namespace reshard
