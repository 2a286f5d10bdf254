// reshard: reshape large-model training checkpoints between parallel layouts
// (TP, PP, DP, EP) and formats (DeepSpeed / Megatron-DeepSpeed, Megatron-Core
// torch_dist, Megatron-LM, torchtitan, Hugging Face, DeepSpeed universal).
//
// The library behind the `reshard` command:
//
//   Lint     dry run: discover the layout, match every tensor against the
//            rule set, report unknown or missing keys, inconsistent shapes
//            and drift between TP-replicated copies.
//   Inspect  a human-readable description of a checkpoint.
//   Convert  write the checkpoint at another TP / PP (and DP) layout.
//   Export   write it in another format (TargetFormats lists them).
//   Verify   compare two checkpoints tensor by tensor, whatever their layouts;
//            VerifyManifest: check an output against the manifest reshard wrote into it.
//   Checkpoint (checkpoint.h): a checkpoint read in place, any rank's state dict.
//
// Every function takes a checkpoint path: a folder of any format reshard
// reads, or a root whose pointer file names one. Inputs are never
// modified. Failures come back as a Status whose message is one line naming
// the problem and the fix.
//
//   reshard::ConvertOptions opts;
//   opts.target_tp = 4;
//   opts.target_pp = 2;
//   reshard::Result<reshard::ConvertReport> r =
//       reshard::Convert("ckpts/global_step20", "out/global_step20", opts);
//   if (!r.ok()) std::cerr << r.status().message() << "\n";
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "reshard/cluster.h"
#include "reshard/progress.h"
#include "reshard/status.h"

namespace reshard {

// One observation about a checkpoint. Errors make Lint fail and Convert refuse.
struct Finding {
  enum class Severity { kError, kWarning, kInfo };
  Severity severity = Severity::kError;
  std::string message;
};

// How TP-replicated tensors (norms, row-parallel biases, ...) are merged.
enum class ReplicatedPolicy {
  kCheck,    // refuse when copies differ (the default)
  kAverage,  // mean of the copies, rounded to the tensor's dtype
  kFirst,    // TP rank 0's copy
};

// Options every command shares.
struct CommonOptions {
  // A rule file path or built-in rule-set name; empty = detect from the checkpoint.
  std::string rules;
  // Pickled classes ("module.name") to carry through unchanged although
  // reshard does not know them. They are never executed.
  std::set<std::string> allowed_classes;
  // Values the rules need that the checkpoint does not record, by metadata
  // path: {"args.num_attention_heads", "16"} (a key without a dot means
  // args.<key>). Refused when the checkpoint records another value or no
  // rule reads it.
  std::map<std::string, std::string> set;
  // The top-level prefixes a DCP folder holds a model's and its optimizer's
  // state dicts under, "MODEL,OPTIM" ("model,optim", "app.model,app.optim"),
  // where its structure does not tell (PyTorch's DCP recipe); empty: found.
  std::string state_dict_prefixes;
  // Only the model weights of a checkpoint that has optimizer state: its
  // optimizer state is not read, so not written (convert, export) or
  // compared (verify), and one that cannot be read (a bf16 run's, which
  // keeps no fp32 master) does not stop the weights.
  bool weights_only = false;
  // Threads for reading and writing; 0 = the number of cores.
  int threads = 0;
  // Check the CRC-32 of every zip record the command reads whole, as it
  // reads it (--no-check-crc: false).
  bool check_crc = true;
  // Receives where the work stands about once a second; may be empty.
  ProgressCallback progress;
};

// What convert is told about the checkpoint, and lint too: lint with the
// same options reports an error for everything convert would refuse the
// checkpoint for (a target layout's own limits aside).
struct PreflightOptions : CommonOptions {
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  // True vocabulary size when the checkpoint does not record it.
  std::optional<int64_t> vocab_size;
};

struct LintOptions : PreflightOptions {
  // The format convert will write (ConvertOptions::to; empty: the source's own).
  std::string to;
  // The layout convert will be given (0: none). Without a target, lint
  // checks what every conversion needs and warns of what a TP change adds.
  int target_tp = 0;
  int target_pp = 0;
  int target_dp = 0;
  int target_ep = 0;
  // Also read every byte of every file and check each record's CRC-32, and
  // have LibTorch's reader read every file (when its module can be loaded).
  bool deep = false;
  // How many of the largest replicated-tensor drifts to list.
  int max_drift_lines = 10;
};

struct LintReport {
  std::string rule_set;  // the rule set used (empty for non-pipeline checkpoints)
  std::string summary;   // layout, iteration, counts
  std::vector<Finding> findings;
  std::vector<std::string> notes;  // checks that were skipped, and why
  // True when no finding is an error: Convert would accept the checkpoint.
  bool ok() const;
};

Result<LintReport> Lint(const std::string& checkpoint, const LintOptions& options);

struct InspectOptions : CommonOptions {};
Result<std::string> Inspect(const std::string& checkpoint, const InspectOptions& options);

// What every command that writes a checkpoint (convert, export) is told.
struct WriteOptions : PreflightOptions {
  bool overwrite = false;       // replace an earlier reshard output, and pointers naming another checkpoint
  bool dry_run = false;         // plan and report; write nothing
  // Resident memory the whole run may use; it sets the streaming buffer of
  // each thread. Refused when reading the metadata already needs it.
  int64_t max_memory = int64_t{1} << 30;
  // Each thread's streaming buffer, which is also the size of its writes;
  // 0 = what the budget allows, up to 1 MiB. Refused if the budget cannot
  // hold it.
  int64_t buffer_size = 0;
  // The processes sharing the work (an MPI job); null = this process alone.
  Cluster* cluster = nullptr;
  // The command recorded in the output's manifest (the CLI: its command line).
  std::string command;
};

// convert: the checkpoint written at another layout, in its own format or
// in the one `to` names.
struct ConvertOptions : WriteOptions {
  // The target format (TargetFormats, or "deepspeed"); empty: the source's
  // own (an HF folder, which has no parallel layout, converts to deepspeed).
  std::string to;
  int target_tp = 0;  // 0 = keep the source's tensor-parallel size
  int target_pp = 0;  // 0 = keep the source's pipeline-parallel size
  int target_dp = 0;  // 0 = keep the source's DP size
  // A model with experts (a target that takes --ep: deepspeed, torch_dist):
  // 0 = keep the source's expert-parallel size.
  int target_ep = 0;
  // The target's own options, as for export (TargetFormats).
  std::map<std::string, std::string> format_options;
};

// One option a target format takes beyond the layout, as the format declares
// it (TargetFormats): the CLI's `--<name>`, the Python module's keyword
// argument (`-` written `_`, `from` as `from_`).
struct FormatOptionInfo {
  enum class Kind {
    kText,   // any text, or one of `choices`
    kCount,  // an integer >= 1
    kFlag,   // given or not: the CLI's `--<name>`, the Python module's `<name>=True`; given, its value is "true"
  };
  std::string name = "";  // "tokenizer", "layer-spec", ...
  Kind kind = Kind::kText;
  std::string help = "";
  std::vector<std::string> choices = {};  // the values it takes; empty = any
  bool bytes = false;                     // kCount: a size in bytes ("5GB" on the command line)
  std::string default_value = "";         // what the format uses when it is not given ("" = nothing)
  // kCount: the target's data-parallel size under its own name (torchtitan's
  // dp-shard), which convert keeps from the source's DP size where it records
  // one (1 for a source saved whole, saying so).
  bool layout = false;
};

// A format reshard writes, as the registry of formats declares it.
struct TargetFormatInfo {
  std::string name = "";    // what --to takes: "hf", "torch_dist", ...
  std::string help = "";    // one line: what it writes
  std::string output = "";  // what OUTPUT is for it
  // The layout sizes (--tp, --pp, --dp, --ep: the expert-parallel size of
  // a model with experts) it takes; others are refused.
  bool tp = false, pp = false, dp = false, ep = false;
  std::vector<FormatOptionInfo> options = {};
};

// Every format `export --to` writes, in the order --help lists them.
const std::vector<TargetFormatInfo>& TargetFormats();

// An export to another format (TargetFormats: consolidated, dcp_recipe, hf, megatron,
// torch_dist, torchtitan, universal).
struct ExportOptions : WriteOptions {
  std::string to;  // the target format's name
  // The target's parallel layout, where its format has one (0: the format's
  // default); a size the target does not take is refused.
  int tp = 0, pp = 0, dp = 0, ep = 0;
  // The target format's own options by name, as it declares them
  // ({"tokenizer", "tok/"}); a name it does not declare, or a value it does
  // not take, is refused before anything is read.
  std::map<std::string, std::string> format_options;
};

struct ConvertReport {
  std::string plan;                // the plan, printable (what --dry-run shows)
  std::vector<std::string> notes;  // what was approximated, merged or filled
  // Under a cluster, the files and bytes are the whole job's (every
  // process's together) and the peak memory the largest process's.
  // Files and tensor bytes the run writes (planned, for a dry run).
  int64_t files = 0;
  int64_t tensor_bytes = 0;
  int64_t bytes_written = 0;  // file sizes (0 for a dry run)
  int64_t bytes_read = 0;     // source tensor bytes read
  int64_t checkpoint_bytes = 0;  // size of the source checkpoint's files
  int64_t memory_budget = 0;
  int64_t memory_estimate = 0;   // expected peak resident memory
  int64_t peak_memory = 0;       // measured peak resident memory (0 for a dry run)
  int64_t buffer_bytes = 0;      // each thread's streaming buffer
  int threads = 0;
  // Wall time of each phase in order ("load", "check", "plan", "write", "commit").
  std::vector<std::pair<std::string, double>> phases;
  double seconds = 0;
};

// Makes an interrupted run leave nothing behind: on SIGINT, SIGTERM or
// SIGHUP the staging folders of outputs in progress are removed (a line on
// stderr names each output left unwritten) before the process dies of the signal, and a file-size limit (SIGXFSZ) fails the
// write that hits it with a clean error instead of killing the process. An
// input file that shrinks under the run (SIGBUS) ends it with one line
// naming the file.
// Call once from main, before any other thread starts.
void CleanUpOnSignals();

// Writes the export into `output` (a new folder), atomically. The report is
// convert's: files, bytes, memory, phases.
Result<ConvertReport> Export(const std::string& input, const std::string& output,
                             const ExportOptions& options);

Result<ConvertReport> Convert(const std::string& input, const std::string& output,
                              const ConvertOptions& options);

struct VerifyOptions : CommonOptions {
  // Rule set for the second checkpoint; empty = same as the first.
  std::string rules_b;
  // Also every record of both checkpoints against its CRC-32 (as lint --deep).
  bool deep = false;
  // How both sides' TP replicas are merged before comparing: kFirst (TP rank
  // 0's copy) or kAverage (the mean, as `convert --replicated average` writes).
  ReplicatedPolicy replicated = ReplicatedPolicy::kFirst;
  int max_difference_lines = 20;
  // Resident memory the comparison may use: tensors are compared a buffer
  // at a time, never built whole.
  int64_t max_memory = int64_t{1} << 30;
  // The processes sharing the comparisons (an MPI job); null = this process
  // alone. Every process returns the whole report.
  Cluster* cluster = nullptr;
};

struct VerifyReport {
  int64_t tensors_compared = 0;
  int64_t elements_compared = 0;
  std::vector<std::string> differences;  // empty = same model
  std::vector<std::string> notes;
  bool same() const { return differences.empty(); }
};

Result<VerifyReport> Verify(const std::string& a, const std::string& b,
                            const VerifyOptions& options);

struct ManifestReport {
  int64_t files_checked = 0;
  int64_t bytes_checked = 0;
  std::string summary;  // the checkpoint's, when the folder is one reshard reads ("" otherwise)
  std::vector<std::string> problems;  // empty = the folder is what reshard wrote, and consistent
  bool ok() const { return problems.empty(); }
};

// Checks an output reshard wrote (a tag folder, a root holding `latest`, or
// an export folder) against its reshard-manifest.json: every file there,
// none missing or added, each of the recorded size and CRC-32; and, for a
// checkpoint reshard reads, lint's consistency checks (ranks, shapes,
// optimizer partitions).
Result<ManifestReport> VerifyManifest(const std::string& folder, const CommonOptions& options);

// A rule set, as `reshard rules` lists it.
struct RuleSetInfo {
  std::string name;
  std::string description;
  std::string origin;  // the file it was read from
};

// The built-in rule sets (rules/*.yaml), each loaded and validated.
Result<std::vector<RuleSetInfo>> ListRuleSets();
// Loads and validates the rule file at `path`; errors name the file and line.
Result<RuleSetInfo> CheckRuleFile(const std::string& path);

// "1.50 GiB", "3.20 MiB": byte counts as reshard's reports print them.
std::string HumanBytes(int64_t bytes);

}  // namespace reshard
