// The formats reshard writes, and PlanConvert / PlanExport: the one place
// that lists them.
// Each target declares its layout sizes and options with its planner; what
// a target does not declare is refused here, before the source is read
// further, so no planner repeats another's option checks.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>

#include "formats/accelerate/accelerate_export.h"
#include "formats/consolidated/consolidated_export.h"
#include "formats/dcp_recipe/dcp_recipe_export.h"
#include "formats/hf/hf_export.h"
#include "formats/megatron_core/torch/megatron_export.h"
#include "formats/megatron_core/torch_dist/torch_dist_export.h"
#include "formats/registry.h"
#include "formats/torchtitan/torchtitan_export.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kDeepSpeed[] = "deepspeed";

// A size of the layout convert writes: as given, else the source's.
Result<int> KeptSize(int given, int saved, const SourceCheckpoint& src, const std::string& flag) {
  if (given > 0) return given;
  if (saved > 0) return saved;
  return Status::InvalidInput("this " + src.info().format + " checkpoint does not record the layout it was saved at; "
                              "give the target's " + flag + " N");
}

// Says which layout sizes not given a source saved whole (an HF folder, a
// state dict) is written at: 1, never silently, with the options to change.
void NoteWholeSizes(const SourceCheckpoint& src, const std::string& to, const std::vector<std::string>& flags,
                    std::vector<std::string>* notes) {
  if (flags.empty()) return;
  notes->push_back(to + ": " + Join(flags, " 1, ") + " 1, as the " + src.info().format + " source is saved whole; give " +
                   (flags.size() == 1 ? "it" : "them") + " to shard it");
}

// The flags among `given` (flag, size) left out (0) for a source saved whole.
std::vector<std::string> WholeSizes(const SourceCheckpoint& src,
                                    std::initializer_list<std::pair<const char*, int>> given) {
  std::vector<std::string> flags;
  if (!src.info().saved_whole) return flags;
  for (const auto& [flag, size] : given) {
    if (size == 0) flags.push_back(flag);
  }
  return flags;
}

// Whether `rules` describe experts (a rule with an expert axis).
bool HasExpertRules(const RuleSet& rules) {
  for (const auto& [role, layer_rules] : rules.layers()) {
    for (const ParamRule& rule : layer_rules) {
      if (rule.expert > 0) return true;
    }
  }
  return false;
}

// The deepspeed target's own options.
constexpr char kLayersPerStageOption[] = "layers-per-stage";
constexpr char kVocabPadValueOption[] = "vocab-pad-value";
constexpr char kNoUpdateLatestOption[] = "no-update-latest";

// --layers-per-stage "5,6,6,5": the blocks of each stage.
Result<std::vector<int>> LayersPerStage(const std::string& text) {
  std::vector<int> out;
  if (text.empty()) return out;
  for (const std::string& part : Split(text, ',')) {
    int64_t n = 0;
    if (!ParseInt(part, &n) || n < 0 || n > (1 << 20)) {
      return Status::InvalidInput(std::string("--") + kLayersPerStageOption + " takes the blocks of each stage, "
                                  "comma-separated (e.g. 5,6,6,5), not '" + text + "'");
    }
    out.push_back(static_cast<int>(n));
  }
  return out;
}

// --vocab-pad-value X: a number.
Result<double> VocabPadValue(const std::string& text) {
  if (text.empty()) return 0.0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !std::isfinite(value)) {
    return Status::InvalidInput(std::string("--") + kVocabPadValueOption + " takes a number, not '" + text + "'");
  }
  return value;
}

// DeepSpeed's own layout (Megatron-DeepSpeed's pipeline, or the source's
// kind: ZeRO-3, MoE), planned by a DeepSpeed source itself; an import
// planned as the pipeline model its rule set describes. DeepSpeed's MoE
// layout (expert files) is written from a DeepSpeed MoE save only: an
// import's experts would land in its pipeline layer files, which
// Megatron-DeepSpeed loads as no MoE model.
Result<OutputPlan> PlanDeepSpeed(const SourceCheckpoint& src, const ExportOptions& options,
                                 std::vector<std::string>* notes) {
  if (!src.info().has_experts && src.info().rules != nullptr && HasExpertRules(*src.info().rules)) {
    const bool megatron_core = src.info().format != "torch_dist" && src.info().rules->section<TorchDistLayout>();
    return Status::Unsupported("this " + src.info().format + " checkpoint's model has experts, and reshard writes "
                               "DeepSpeed's MoE layout only from a DeepSpeed MoE save; convert --to " +
                               (megatron_core ? "torch_dist (Megatron-Core), --to " : "") + src.info().format +
                               " or --to consolidated");
  }
  if (options.ep > 0 && !src.info().has_experts) {
    return Status::InvalidInput("--ep sets the expert-parallel size of a DeepSpeed MoE checkpoint, and this " +
                                src.info().kind + " checkpoint has no experts; leave it out");
  }
  DeepSpeedPlanOptions native;
  static_cast<WriteOptions&>(native) = options;
  RESHARD_ASSIGN_OR_RETURN(native.target_tp, KeptSize(options.tp, src.info().tp, src, "--tp"));
  RESHARD_ASSIGN_OR_RETURN(native.target_pp, KeptSize(options.pp, src.info().pp, src, "--pp"));
  native.target_dp = options.dp;
  native.target_ep = options.ep;
  RESHARD_ASSIGN_OR_RETURN(native.layers_per_stage, LayersPerStage(FormatOption(options, kLayersPerStageOption)));
  RESHARD_ASSIGN_OR_RETURN(native.vocab_pad_value, VocabPadValue(FormatOption(options, kVocabPadValueOption)));
  native.update_latest = !FormatFlag(options, kNoUpdateLatestOption);
  RESHARD_RETURN_IF_ERROR(CheckPipelineComputes(src));
  NoteWholeSizes(src, kDeepSpeed, WholeSizes(src, {{"--tp", options.tp}, {"--pp", options.pp}}), notes);
  return src.Plan(native, notes);
}

TargetFormat DeepSpeedTarget() {
  using Kind = FormatOptionInfo::Kind;
  TargetFormatInfo info{kDeepSpeed, "DeepSpeed / Megatron-DeepSpeed at --tp / --pp / --dp, with its optimizer state",
                        "the tag folder, written exactly there (e.g. out/global_step20), with 'latest' beside it"};
  info.tp = info.pp = info.dp = info.ep = true;
  info.options = {
      {kLayersPerStageOption, Kind::kText,
       "Transformer blocks per target stage, comma-separated, e.g. 5,6,6,5 (default: DeepSpeed's partition method "
       "recorded in the checkpoint)"},
      {kVocabPadValueOption, Kind::kText, "The value of the vocabulary padding rows the target adds (default 0)"},
      {kNoUpdateLatestOption, Kind::kFlag,
       "Do not write 'latest' (nor the root's zero_to_fp32.py) beside the output folder"}};
  return {std::move(info), PlanDeepSpeed};
}

// DeepSpeed's universal checkpoint, planned by a DeepSpeed source itself.
TargetFormat UniversalTarget() {
  TargetFormatInfo info{"universal", "DeepSpeed's universal checkpoint (one folder per parameter)",
                        "the tag folder, e.g. ckpts/global_step20_universal, named by latest_universal beside it"};
  return {std::move(info), [](const SourceCheckpoint& src, const ExportOptions& options, std::vector<std::string>* notes)
                               -> Result<OutputPlan> {
            RESHARD_RETURN_IF_ERROR(CheckPipelineComputes(src));
            return src.PlanFamilyFormat(options, notes);
          }};
}

const std::vector<TargetFormat>& Targets() {
  static const std::vector<TargetFormat> targets = {
      DeepSpeedTarget(), AccelerateTarget(), ConsolidatedTarget(), DcpRecipeTarget(), HfTarget(),
      MegatronTarget(),   TorchDistTarget(), TorchtitanTarget(),   UniversalTarget()};
  return targets;
}

const TargetFormat* FindTarget(const std::string& name) {
  for (const TargetFormat& t : Targets()) {
    if (t.info.name == name) return &t;
  }
  return nullptr;
}

std::vector<std::string> TargetNames() {
  std::vector<std::string> names;
  for (const TargetFormat& t : Targets()) names.push_back(t.info.name);
  return names;
}

}  // namespace

Status CheckTargetFormat(const std::string& to) {
  if (FindTarget(to) != nullptr) return Status::Ok();
  const std::vector<std::string> names = TargetNames();
  const std::string* guess = ClosestName(to, names);
  return Status::InvalidInput("unknown target format '" + to + "'; " +
                              (guess != nullptr ? "did you mean '" + *guess + "'? (the formats: " + Join(names, ", ") + ")"
                                                : "the formats: " + Join(names, ", ")));
}

namespace {

// "--to megatron, torch_dist": the targets that declare option `name`.
std::string TargetsTaking(const std::string& name) {
  std::vector<std::string> takers;
  for (const TargetFormat& t : Targets()) {
    for (const FormatOptionInfo& o : t.info.options) {
      if (o.name == name) takers.push_back(t.info.name);
    }
  }
  return takers.empty() ? "no export" : "--to " + Join(takers, ", ");
}

// Refuses a layout size `target` does not take, naming those that do.
Status CheckLayout(const TargetFormatInfo& target, const ExportOptions& options) {
  const struct {
    const char* flag;
    int value;
    bool TargetFormatInfo::*taken;
  } sizes[] = {{"--tp", options.tp, &TargetFormatInfo::tp},
               {"--pp", options.pp, &TargetFormatInfo::pp},
               {"--dp", options.dp, &TargetFormatInfo::dp},
               {"--ep", options.ep, &TargetFormatInfo::ep}};
  for (const auto& size : sizes) {
    if (size.value == 0 || target.*size.taken) continue;
    std::vector<std::string> takers;
    for (const TargetFormat& t : Targets()) {
      if (t.info.*size.taken) takers.push_back(t.info.name);
    }
    return Status::InvalidInput(std::string(size.flag) + " sets the layout of --to " + Join(takers, ", ") + "; --to " +
                                target.name + " has no such size, so leave it out");
  }
  return Status::Ok();
}

// Refuses a value `option` does not take.
Status CheckValue(const FormatOptionInfo& option, const std::string& value) {
  if (option.kind == FormatOptionInfo::Kind::kCount) {
    int64_t n = 0;
    if (!ParseInt(value, &n) || n < 1) return Status::InvalidInput("--" + option.name + " takes a whole number >= 1, not '" + value + "'");
    return Status::Ok();
  }
  if (option.kind == FormatOptionInfo::Kind::kFlag) {
    if (value == "true") return Status::Ok();
    return Status::InvalidInput("--" + option.name + " is a flag, given or not; it takes no value ('" + value + "')");
  }
  if (option.choices.empty() || std::count(option.choices.begin(), option.choices.end(), value)) return Status::Ok();
  return Status::InvalidInput("--" + option.name + " does not take '" + value + "'; " + Hint(value, option.choices));
}

// `options` with every option the target declares a default for set, once
// each given one is checked against the declaration.
Result<ExportOptions> CheckedOptions(const TargetFormatInfo& target, const ExportOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckLayout(target, options));
  ExportOptions checked = options;
  for (const auto& [name, value] : options.format_options) {
    auto declared = std::find_if(target.options.begin(), target.options.end(),
                                 [&name = name](const FormatOptionInfo& o) { return o.name == name; });
    if (declared == target.options.end()) {
      return Status::InvalidInput("--" + name + " is an option of " + TargetsTaking(name) + "; --to " + target.name +
                                  " does not take it, so leave it out");
    }
    RESHARD_RETURN_IF_ERROR(CheckValue(*declared, value));
  }
  for (const FormatOptionInfo& o : target.options) {
    if (!o.default_value.empty()) checked.format_options.emplace(o.name, o.default_value);
  }
  return checked;
}

// The format convert writes: as asked, else the source's own. An HF folder
// has no parallel layout to keep, and converts to deepspeed, as it always
// has; so does a format reshard does not write (a plain DCP folder, a state
// dict), whose refusal then says what it lacks.
Result<std::string> ConvertTarget(const SourceCheckpoint& src, const ConvertOptions& options) {
  if (!options.to.empty()) {
    if (FindTarget(options.to) != nullptr) return options.to;
    return CheckTargetFormat(options.to);
  }
  const std::string& own = src.info().format;
  return own != "hf" && FindTarget(own) != nullptr ? own : std::string(kDeepSpeed);
}

// What convert asks of the target `to`, as export options: each layout size
// the target has and the user did not give kept from the source.
ExportOptions KeptLayout(const SourceCheckpoint& src, const ConvertOptions& options, const std::string& to,
                         std::vector<std::string>* notes) {
  const TargetFormatInfo& target = FindTarget(to)->info;
  ExportOptions exporting;
  static_cast<WriteOptions&>(exporting) = options;
  exporting.to = to;
  exporting.format_options = options.format_options;
  exporting.tp = options.target_tp > 0 || !target.tp ? options.target_tp : src.info().tp;
  exporting.pp = options.target_pp > 0 || !target.pp ? options.target_pp : src.info().pp;
  exporting.dp = options.target_dp > 0 || !target.dp ? options.target_dp : src.info().dp;
  // A model with experts saved whole has them all in one place: EP 1.
  const bool whole_experts = src.info().saved_whole && src.info().ep == 0 && src.info().rules != nullptr &&
                             HasExpertRules(*src.info().rules);
  exporting.ep = options.target_ep > 0 || !target.ep ? options.target_ep : whole_experts ? 1 : src.info().ep;
  std::vector<std::string> whole = WholeSizes(src, {{"--tp", target.tp ? options.target_tp : -1},
                                                    {"--pp", target.pp ? options.target_pp : -1},
                                                    {"--dp", target.dp ? options.target_dp : -1},
                                                    {"--ep", target.ep && whole_experts ? options.target_ep : -1}});
  for (const FormatOptionInfo& o : target.options) {
    if (!o.layout || options.format_options.count(o.name) || src.info().dp < 1) continue;
    exporting.format_options[o.name] = std::to_string(src.info().dp);  // the source's DP size
    if (src.info().saved_whole) whole.push_back("--" + o.name);
  }
  NoteWholeSizes(src, to, whole, notes);
  return exporting;
}

}  // namespace

bool RecordsItsLayout(const SourceCheckpoint& src) {
  const SourceInfo& info = src.info();
  if (info.tp < 1) return false;
  return info.has_experts || info.ep > 0 || info.rules == nullptr || !HasExpertRules(*info.rules);
}

const std::vector<TargetFormatInfo>& TargetFormats() {
  static const std::vector<TargetFormatInfo> infos = [] {
    std::vector<TargetFormatInfo> out;
    for (const TargetFormat& t : Targets()) out.push_back(t.info);
    return out;
  }();
  return infos;
}

Result<OutputPlan> PlanConvert(const SourceCheckpoint& src, const ConvertOptions& options,
                               std::vector<std::string>* notes) {
  for (const auto& [flag, size] : {std::pair<const char*, int>{"--tp", options.target_tp}, {"--pp", options.target_pp},
                                   {"--dp", options.target_dp}, {"--ep", options.target_ep}}) {
    if (size < 0) return Status::InvalidInput(std::string(flag) + " " + std::to_string(size) + ": a size is at least 1");
  }
  RESHARD_ASSIGN_OR_RETURN(const std::string to, ConvertTarget(src, options));
  return PlanExport(src, KeptLayout(src, options, to, notes), notes);
}

Result<OutputPlan> PlanExport(const SourceCheckpoint& src, const ExportOptions& options,
                              std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckTargetFormat(options.to));
  const TargetFormat* target = FindTarget(options.to);
  ExportOptions kept = options;  // with the options the source was saved with, to its own format
  if (options.to == src.info().format) kept.format_options.insert(src.info().format_options.begin(),
                                                                  src.info().format_options.end());
  RESHARD_ASSIGN_OR_RETURN(ExportOptions checked, CheckedOptions(target->info, kept));
  // A target written from whole tensors merges the source's TP replicas,
  // checked first; DeepSpeed's own layout is planned by the source, which
  // checks what it merges.
  if (!checked.dry_run && target->info.name != kDeepSpeed) {
    RESHARD_RETURN_IF_ERROR(src.CheckReplicas(checked.replicated, notes));
  }
  return target->plan(src, checked, notes);
}

}  // namespace reshard
