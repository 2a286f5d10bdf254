// reshard: reshape DeepSpeed / Megatron-DeepSpeed checkpoints between
// tensor- (TP), pipeline- (PP) and data-parallel (DP) layouts.
//
// The library behind the `reshard` command. Four entry points:
//
//   Lint     dry run: discover the layout, match every tensor against the
//            rule set, report unknown or missing keys, inconsistent shapes
//            and drift between TP-replicated copies.
//   Inspect  a human-readable description of a checkpoint.
//   Convert  write the checkpoint at another TP / PP (and DP) layout.
//   Verify   compare two checkpoints tensor by tensor, whatever their layouts;
//            VerifyManifest: check an output against the manifest reshard wrote into it.
//
// Every function takes a checkpoint path that is either a tag folder
// (`ckpts/global_step20`) or a root holding `latest`. Inputs are never
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
  // Threads for reading and writing; 0 = the number of cores.
  int threads = 0;
  // Check the CRC-32 of every zip record the command reads whole, as it
  // reads it (--no-check-crc: false).
  bool check_crc = true;
  // Receives progress lines ("12/40 files, 1.2 GB"); may be empty.
  std::function<void(const std::string&)> progress;
};

// What convert is told about the checkpoint, and lint too: lint with the
// same options reports an error for everything convert would refuse the
// checkpoint for (a target layout's own limits aside).
struct PreflightOptions : CommonOptions {
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  // Convert only the model weights of a checkpoint that has optimizer state.
  bool weights_only = false;
  // True vocabulary size when the checkpoint does not record it.
  std::optional<int64_t> vocab_size;
};

struct LintOptions : PreflightOptions {
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

struct ConvertOptions : WriteOptions {
  int target_tp = 0;  // required, >= 1
  int target_pp = 0;  // required, >= 1
  int target_dp = 0;  // 0 = keep the source's DP size
  int target_ep = 0;  // DeepSpeed MoE: 0 = keep the source's expert-parallel size
  // Explicit transformer blocks per target stage (sums to the block count);
  // empty = DeepSpeed's partition method recorded in the checkpoint.
  std::vector<int> layers_per_stage;
  // Value of vocabulary padding rows that the target layout adds.
  double vocab_pad_value = 0.0;
  bool update_latest = true;    // write `latest` next to the output folder
};

// An export to another format: "consolidated" (the checkpoint's full tensors
// under their canonical names, from the fp32 masters where the checkpoint has
// optimizer state, from the weights with `weights_only`), "hf" (a Hugging
// Face transformers folder, as the rule set's hf section maps it; from the
// weights unless `from` is "masters"), "megatron" (NVIDIA Megatron-LM's
// legacy torch checkpoint at TP `tp` and PP `pp`; weights unless `from` is
// "masters"), "torch_dist" (Megatron-Core's distributed checkpoint at TP `tp`
// and PP `pp`, weights alike, with the optimizer state unless `weights_only`)
// or "universal" (DeepSpeed's).
struct ExportOptions : WriteOptions {
  std::string to;  // "consolidated", "hf", "megatron", "torch_dist", "torchtitan" or "universal"
  // megatron, torch_dist: the target tensor- and pipeline-parallel sizes
  // (required there, refused elsewhere).
  int tp = 0, pp = 0;
  // torch_dist: the data-parallel size the optimizer state is laid out for
  // (0 = 1; refused elsewhere).
  int dp = 0;
  // torchtitan: the FSDP2 world size the parameters are sharded over
  // (required there, refused elsewhere).
  int dp_shard = 0;
  std::string dtype;  // "fp32", "bf16", "fp16"; empty = as stored
  // Largest file; a bigger tensor gets a file of its own.
  int64_t max_shard_size = int64_t{5} * 1000 * 1000 * 1000;
  std::string file_format = "safetensors";  // or "pt" (torch.save)
  // Where the tensors come from: "masters" (the fp32 masters), "weights", or
  // empty for the format's default (consolidated: masters; hf: weights).
  std::string from;
  // hf: a folder whose tokenizer files are copied beside the model; empty = none.
  std::string tokenizer;
  // megatron: whose model's keys the files hold: "local" (the default) or
  // "te", Megatron-Core's GPTModel with its local or Transformer Engine
  // layer spec; "legacy", the legacy GPTModel (--use-legacy-models).
  std::string layer_spec;
  // torch_dist: the layout of the optimizer state, written whenever the
  // source has some and weights_only is not set: Megatron-Core 0.19's
  // "fully_reshardable" or "dp_reshardable" (its training default: flat
  // buckets per model-parallel rank, sharded over `dp`), or 0.14's
  // "fully_sharded_model_space" (its default). Empty: the version's default
  // (0.14: fully_sharded_model_space; 0.19: a torch_dist source's own layout
  // where it is dp_reshardable, else fully_reshardable).
  std::string optimizer_layout;
  // torch_dist: the Megatron-Core version whose form is written, "0.14"
  // (common.pt, fully_sharded_model_space) or "0.19" (the common_state item,
  // fully_reshardable / dp_reshardable). Empty: the version the
  // optimizer_layout belongs to, else a torch_dist source's own, else 0.19.
  std::string megatron_core_version;
  // torch_dist, dp_reshardable: Megatron-LM's --ddp-bucket-size, the
  // elements after which a grad buffer's bucket closes on the first pipeline
  // stage (as with --overlap-grad-reduce); 0: one bucket per buffer.
  int64_t ddp_bucket_size = 0;
};

struct ConvertReport {
  std::string plan;                // the plan, printable (what --dry-run shows)
  std::vector<std::string> notes;  // what was approximated, merged or filled
  // Files and tensor bytes this process writes (planned, for a dry run).
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
// SIGHUP the staging folders of outputs in progress are removed before the
// process dies of the signal, and a file-size limit (SIGXFSZ) fails the
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
