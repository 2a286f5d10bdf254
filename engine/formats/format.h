// The seam between on-disk formats and the commands.
//
// A format recognises a checkpoint folder and opens it as a
// SourceCheckpoint: everything `lint`, `inspect`, `convert` and `verify` need
// of a checkpoint, whatever its files look like. A format that is written
// declares itself as a TargetFormat: its layout sizes and options, and how it
// plans an OutputPlan (plan/output_plan.h) from any source, which
// exec/plan_writer turns into jobs for the executor. Every format folder
// includes this interface and no other format folder; only the registry
// (formats/registry.h) includes them. A new format is a folder beside
// formats/deepspeed/ and a line in OpenCheckpoint (a source) or in the
// table of targets (a target).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "pickle/value.h"
#include "plan/output_plan.h"
#include "plan/tensor_plan.h"
#include "reshard/reshard.h"
#include "rules/rule_set.h"
#include "util/byte_producer.h"

namespace reshard {

// FullTensor::state of the fp32 master weights.
inline constexpr char kFp32Master[] = "fp32";

// The run state a DeepSpeed checkpoint records: the iteration (SourceInfo::
// iteration) and the metadata's scheduler and counters.
inline constexpr char kIterationKey[] = "iteration";
inline constexpr const char* kRunStateKeys[] = {kIterationKey, "lr_scheduler", "global_samples", "skipped_steps"};

// One tensor whole, made a range at a time: what verify compares and what
// exports write.
struct FullTensor {
  // "weights" or "optimizer": when only one side has a section at all, it is
  // a note, not a difference (a weights-only conversion is the same model).
  std::string section;
  std::string name;  // unique in the checkpoint: what verify matches the two sides by
  std::string param;  // the canonical name of the parameter it is (or is a state of)
  std::string state;  // "" for weights; the optimizer state ("fp32", "exp_avg", ...)
  std::string where;  // where it lies in this checkpoint, for messages ("" = the name says it)
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  bool vocab = false;  // dim 0 is a padded vocabulary: rows both sides have are compared
  ByteProducer produce;  // bytes of the whole tensor, row-major

  // Its name, and where it lies when the name does not say: what messages
  // and --dry-run call it ("layers.1.mlp.dense_4h_to_h.weight at layer_04/...").
  std::string Label() const { return where.empty() || where == name ? name : name + " at " + where; }
};

// Whether `all` holds any optimizer state, and any fp32 master.
bool HoldsOptimizerState(const std::vector<FullTensor>& all);
bool HoldsFp32Masters(const std::vector<FullTensor>& all);

// How a source cuts its weights for another tensor-parallel layout
// (SourceCheckpoint::WeightsForTp).
struct TpCut {
  int tp = 1;
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  std::optional<int64_t> vocab_size;  // true vocabulary rows, when the source does not record them
  // "": the weights; else this optimizer state of each parameter instead
  // (kFp32Master, "exp_avg", ...), cut the same way.
  std::string state;
};

// One weight as a target TP rank holds it.
struct RankTensor {
  const ParamRule* rule = nullptr;  // its rule: layer role, TP policy, tied
  int block = -1;                   // its transformer block, from 0 (-1 outside blocks)
  std::string key;                  // its module-local key in the layer ("self_attention.dense.weight")
  std::string name;                 // canonical
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;       // the rank's
  std::string detail;               // where its elements come from, for --dry-run
  ByteProducer produce;             // bytes of the rank's tensor, row-major

  // Its name, its TP policy and `detail`: what --dry-run says it is made of.
  std::string Label() const;
};

struct TpWeights {
  int64_t padded_vocab = 0;  // rows of the vocabulary tensors over all ranks (0: none)
  std::vector<std::vector<RankTensor>> ranks;  // per TP rank, every weight in layer order
};

// One group of a source's optimizer, as plain data: what a target writes
// its own param groups from.
struct OptimizerParamGroup {
  // The torch param group's hyperparameters as the source records them (lr,
  // betas, eps, weight_decay, ...): a dict-like value without `params` and `step`.
  Value hyperparameters = Value::MakeDict();
  double weight_decay_multiplier = 1.0;  // 1: the group's parameters decay; 0: they do not
  std::vector<std::string> params;       // canonical names
};

// A source's optimizer groups, decayed groups first, and its step.
struct OptimizerParamGroups {
  std::vector<OptimizerParamGroup> groups;
  std::optional<Value> step;  // where the source records one
};

// What a checkpoint is, known once it is open.
struct SourceInfo {
  // The format that read it, as --to names it where reshard writes it
  // ("deepspeed", "torch_dist", "torchtitan", "megatron", "hf"; also "dcp",
  // "state dict"): what convert writes by default.
  std::string format;
  // The parallel layout it was saved at, where the format records it (0:
  // not recorded): what convert keeps of it when not told otherwise. `ep`
  // only for a model with experts whose format records it apart from its
  // own planner (torch_dist; a DeepSpeed MoE save keeps its own).
  int tp = 0, pp = 0, dp = 0, ep = 0;
  // Saved as whole tensors (an HF folder, a state dict): at size 1 in every
  // layout dimension, which convert takes, with a note, for the sizes of a
  // target not given.
  bool saved_whole = false;
  // "pipeline", "non-pipeline", "ZeRO-3", "MoE" (DeepSpeed's), "model" (a
  // model another format read), "DCP", ...: what messages call it.
  std::string kind;
  std::string tag_dir;   // the folder holding the files
  std::vector<std::string> files;  // every file of the checkpoint (lint --deep checks their bytes)
  int64_t iteration = 0;
  std::string summary;   // one line: kind, layout, iteration, counts
  std::vector<Finding> findings;  // problems found while reading (errors make convert refuse)
  // What reading chose that the user should know (a value the checkpoint
  // does not record filled by a default, what no target carries): every
  // command that reads the checkpoint says them.
  std::vector<std::string> notes;
  Value metadata;        // what verify compares (scheduler, counters): a dict-like value
  // The rule set that describes the tensors (null for a checkpoint read
  // without rules), and the --set values its rules read beside the metadata.
  std::shared_ptr<const RuleSet> rules;
  Value settings = Value::MakeDict();
  int64_t vocab_rows = 0;              // rows of the vocabulary tensors (0 when none)
  std::optional<int64_t> vocab_size;   // the true vocabulary size, when the checkpoint records it
  // The vocabulary padding's divisor (Megatron's make_vocab_size_divisible_by),
  // where the checkpoint or --set gives it.
  std::optional<int64_t> vocab_divisible_by;
  bool has_experts = false;            // DeepSpeed MoE: its EP size is what convert --ep sets
  // How the source's format laid its optimizer state out, where it names
  // it (torch_dist: "dp_reshardable"): an export to that format keeps it.
  std::string optimizer_layout;
  // The version of the writer whose form the source has, where its format
  // has several (torch_dist: "0.14" for Megatron-Core's common.pt form and
  // its layout fully_sharded_model_space, "0.19" for the common_state item):
  // an export to that format writes it by default.
  std::string format_version;
  // The run state the checkpoint records, by the names verify compares it
  // under (kRunStateKeys): an import's format records its iteration at most
  // (its metadata is otherwise a fresh run's), an HF folder or a state dict
  // nothing. What one side of verify does not record is a note, not a
  // difference.
  std::set<std::string> run_state{std::begin(kRunStateKeys), std::end(kRunStateKeys)};
  // The options of its own format's target it was saved with, where the
  // format records them (dcp_recipe: its prefixes, the form of its param
  // groups), by option name: an export to that format takes each not given.
  std::map<std::string, std::string> format_options;
  // Why no rule set describes a checkpoint that one was looked for (a
  // torch_dist folder whose family's rules refused it): what the refusals
  // of commands that need one add.
  std::string no_rules_reason;

  // " (<no_rules_reason>)", or empty.
  std::string NoRulesWhy() const { return no_rules_reason.empty() ? "" : " (" + no_rules_reason + ")"; }
};

// A checkpoint opened by its format: what it is (info), and the operations
// the commands ask of it.
// What a source plans DeepSpeed's own layout with (SourceCheckpoint::Plan):
// the target's sizes and the deepspeed target's own options.
struct DeepSpeedPlanOptions : WriteOptions {
  int target_tp = 0, target_pp = 0;  // given, or the source's
  int target_dp = 0, target_ep = 0;  // 0 = keep the source's
  // Explicit transformer blocks per target stage (summing to the block
  // count); empty = DeepSpeed's partition method recorded in the checkpoint.
  std::vector<int> layers_per_stage;
  double vocab_pad_value = 0.0;  // of the vocabulary padding rows the target adds
  bool update_latest = true;     // write `latest` beside the output folder
};

class SourceCheckpoint {
 public:
  virtual ~SourceCheckpoint() = default;

  const SourceInfo& info() const { return info_; }

  // Everything convert would object to, and what it would do: rule set,
  // summary, findings (the reading findings first).
  virtual void Lint(const LintOptions& options, LintReport* report) const = 0;
  // The body of `inspect` after its first line.
  virtual std::string Describe() const = 0;
  // Checks the source against the options (drift policies, ...) and plans
  // it in DeepSpeed's layout; `notes` receives what the user should know
  // (what was approximated, merged or filled).
  virtual Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>* notes) const = 0;
  // Plans the source in a format of its own family other than its native
  // layout, as `options.to` names it, for a target only the family writes.
  virtual Result<OutputPlan> PlanFamilyFormat(const ExportOptions& options, std::vector<std::string>*) const {
    return Status::Unsupported("a " + info_.kind + " checkpoint cannot be exported --to " + options.to);
  }
  // Every tensor, weights and optimizer state, TP replicas merged by
  // `replicated`. Producers add the bytes they read to *read.
  virtual Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy replicated,
                                                      std::atomic<int64_t>* read) const = 0;
  // Every weight cut for `cut.tp` TP ranks exactly as convert cuts the layer
  // files (which hold Megatron's own per-rank tensors), the vocabulary padded
  // for that TP with zero rows; `notes` learns what the re-padding did.
  // Producers add the bytes they read to *read.
  virtual Result<TpWeights> WeightsForTp(const TpCut&, std::vector<std::string>*, std::atomic<int64_t>*) const {
    return Status::Unsupported("a " + info_.kind + " checkpoint has no rule set describing its tensors' "
                               "tensor-parallel layout, so it cannot be cut for another TP size");
  }
  // Refuses TP replicas that differ where `replicated` says to check them
  // (convert's own check, for commands that merge replicas through
  // FullTensors); `notes` learns what will be merged.
  virtual Status CheckReplicas(ReplicatedPolicy, std::vector<std::string>*) const { return Status::Ok(); }
  // The optimizer's param groups and step, for a target that writes its own
  // (the states themselves are FullTensors' "optimizer" section).
  virtual Result<OptimizerParamGroups> ParamGroupsAndStep() const {
    return Status::Unsupported("a " + info_.kind + " checkpoint does not give its optimizer's param groups; "
                               "export with --weights-only");
  }
  // The values reading the tensors needs that neither the checkpoint, its
  // rule file nor --set gives (the rules' block counts), and with
  // `repad_tp` those re-padding the vocabulary for that TP needs: what a
  // command names, with the values of its own, in one refusal.
  virtual std::vector<MissingValue> MissingValues(std::optional<int> /*repad_tp*/,
                                                  std::optional<int64_t> /*vocab_size*/) const {
    return {};
  }
  // Observations verify reports about this side (replicas that differ, ...).
  virtual std::vector<std::string> VerifyNotes() const { return {}; }

  // The registry names the format that opened the checkpoint and the layout
  // it was saved at, where the reader found it (0: leaves the size as the
  // source set it).
  void SetOrigin(const std::string& format, int tp = 0, int pp = 0, int dp = 0, int ep = 0) {
    info_.format = format;
    if (tp > 0) info_.tp = tp;
    if (pp > 0) info_.pp = pp;
    if (dp > 0) info_.dp = dp;
    if (ep > 0) info_.ep = ep;
  }

  // The registry records the options of its format's target the
  // checkpoint was saved with (SourceInfo::format_options).
  void SetFormatOptions(std::map<std::string, std::string> options) { info_.format_options = std::move(options); }

  // The registry marks a checkpoint saved as whole tensors.
  void SetSavedWhole() {
    info_.saved_whole = true;
    info_.tp = info_.pp = info_.dp = 1;
  }

 protected:
  SourceInfo info_;  // set by the format as it opens the checkpoint
};

// A format reshard writes: what it declares (its name, the layout sizes and
// options it takes: TargetFormats() publishes them, and PlanExport refuses
// what a target does not declare), and how it plans the files from a source.
struct TargetFormat {
  TargetFormatInfo info;
  // Called with every option the target declares set: as given, else its
  // default. `src` must outlive the plan and its jobs.
  std::function<Result<OutputPlan>(const SourceCheckpoint& src, const ExportOptions& options,
                                   std::vector<std::string>* notes)>
      plan;
};

// The value of the target option `name` (its default when not given; "" when
// it has neither). Only for a name the target declares.
inline std::string FormatOption(const ExportOptions& options, const std::string& name) {
  auto it = options.format_options.find(name);
  return it == options.format_options.end() ? "" : it->second;
}
// The same, of a kCount option (0 when neither given nor defaulted).
int64_t FormatCount(const ExportOptions& options, const std::string& name);
// Whether the flag option `name` was given.
inline bool FormatFlag(const ExportOptions& options, const std::string& name) {
  return FormatOption(options, name) == "true";
}

// Options several targets declare alike.
// --from: the tensors from the fp32 masters or the weights, `fallback` by default.
FormatOptionInfo FromOption(const std::string& fallback);
// --dtype: floating tensors cast to fp32, bf16 or fp16 (default: as stored).
FormatOptionInfo DTypeOption();

}  // namespace reshard
