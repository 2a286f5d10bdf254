// reshard: the command-line interface, a thin layer over the engine library.
//
// Exit status: 0 success; 1 lint found errors or verify found differences;
// 2 unusable input or arguments (nothing written); 3 I/O or internal errors.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "progress_display.h"
#include "reshard/cluster.h"
#include "reshard/names.h"
#include "reshard/reshard.h"

// "reshard X.Y.Z", the commit and the build type: build/version.cc, written
// at build time by cmake/version.cmake.
std::string VersionText();

namespace {

using reshard::Status;

int ExitCode(const Status& st) {
  switch (st.code()) {
    case Status::Code::kOk: return 0;
    case Status::Code::kInvalidInput:
    case Status::Code::kRuleError:
    case Status::Code::kUnsupported: return 2;
    default: return 3;
  }
}

// -v: messages printed whole; without it each is cut to two lines.
bool verbose = false;

// `text` as printed: whole with -v or when it has at most two lines, else
// its first line and how many more there are.
std::string Clipped(const std::string& text) {
  const size_t first_end = text.find('\n');
  const auto more = std::count(text.begin() + (first_end == std::string::npos ? 0 : first_end), text.end(), '\n');
  if (verbose || more < 2) return text;
  return text.substr(0, first_end) + "\n  ... and " + std::to_string(more) + " more lines (-v shows them)";
}

int Fail(const Status& st) {
  std::cerr << "reshard: error: " << Clipped(st.message()) << "\n";
  return ExitCode(st);
}

// Options shared by every subcommand that reads a checkpoint.
void AddCommonOptions(CLI::App* cmd, reshard::CommonOptions* o) {
  cmd->add_option("--rules", o->rules,
                  "Rule set: a YAML file or a built-in name (default: detected from the checkpoint); 'none' reads "
                  "a Distributed Checkpoint (DCP, torch_dist) as it is, every item under its key");
  cmd->add_option("--allow-class", o->allowed_classes,
                  "Carry an unknown pickled class (module.name) through unchanged; never executed");
  cmd->add_option("--state-dict-prefixes", o->state_dict_prefixes,
                  "MODEL,OPTIM: the top-level prefixes a DCP folder saved by PyTorch's DCP recipe holds its model "
                  "and optimizer under (default: found by their structure), e.g. app.model,app.optim");
  cmd->add_option("--threads", o->threads, "Worker threads (default: the number of cores)")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag_function(
      "--no-check-crc", [o](int64_t) { o->check_crc = false; },
      "Do not check the CRC-32 of the zip records read whole (checked by default, as they are read)");
  cmd->add_option_function<std::vector<std::string>>(
         "--set",
         [o](const std::vector<std::string>& items) {
           for (const std::string& item : items) {
             const size_t eq = item.find('=');
             o->set[item.substr(0, eq)] = item.substr(eq + 1);
           }
         },
         "A value the rules need that the checkpoint does not record, as PATH=VALUE "
         "(e.g. num_attention_heads=16, short for args.num_attention_heads); repeatable")
      ->check([](const std::string& item) {
        return item.find('=') == std::string::npos || item.front() == '='
                   ? "--set takes PATH=VALUE, e.g. --set num_attention_heads=16"
                   : "";
      });
}

// --replicated, --weights-only, --vocab-size: what lint and convert are
// both told about the checkpoint, so that lint checks what convert will do.
void AddPreflightOptions(CLI::App* cmd, reshard::PreflightOptions* o) {
  AddCommonOptions(cmd, o);
  cmd->add_option_function<std::string>(
         "--replicated",
         [o](const std::string& policy) {
           o->replicated = policy == "average" ? reshard::ReplicatedPolicy::kAverage
                           : policy == "first" ? reshard::ReplicatedPolicy::kFirst
                                               : reshard::ReplicatedPolicy::kCheck;
         },
         "Replicated tensors that differ across TP ranks: check (refuse; the default), "
         "average, or first (TP rank 0)")
      ->check(CLI::IsMember({"check", "average", "first"}));
  cmd->add_flag("--weights-only", o->weights_only,
                "Only the weights of a checkpoint that has optimizer state: the optimizer state is "
                "left out");
  cmd->add_option("--vocab-size", o->vocab_size,
                  "True vocabulary size, when the checkpoint does not record it");
}

// What every command that shows progress takes.
void AddProgressOption(CLI::App* cmd, double* log_interval) {
  cmd->add_option("--progress-interval", *log_interval,
                  "Seconds between progress lines when stderr is not a terminal, as under mpirun (default 5)")
      ->check(CLI::NonNegativeNumber);
}

// --overwrite, --dry-run, --max-memory, -q and the preflight options: what
// every command that writes a checkpoint takes.
void AddWriteOptions(CLI::App* cmd, reshard::WriteOptions* o, bool* quiet, double* log_interval) {
  cmd->add_flag("--overwrite", o->overwrite,
                "Replace an earlier reshard output at OUTPUT, and a pointer such as 'latest' naming another checkpoint");
  cmd->add_flag("--dry-run", o->dry_run,
                "Print the plan, the files and bytes to write and the memory estimate; write nothing");
  cmd->add_option("--max-memory", o->max_memory,
                  "Resident memory the run may use, e.g. 512MiB or 4GiB (default 1GiB); sets each "
                  "thread's streaming buffer")
      ->transform(CLI::AsSizeValue(false));
  cmd->add_option("--buffer-size", o->buffer_size,
                  "Each thread's streaming buffer and write size, e.g. 256KiB (default: up to 1MiB, as "
                  "--max-memory allows)")
      ->transform(CLI::AsSizeValue(false));
  cmd->add_flag("-q,--quiet", *quiet, "Print only errors and the summary (no progress, plan or notes)");
  AddProgressOption(cmd, log_interval);
  AddPreflightOptions(cmd, o);
}

// ---- the target formats' options, as the engine declares them ----

std::string Join(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : sep) + item;
  return out;
}

std::vector<std::string> TargetNames() {
  std::vector<std::string> names;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) names.push_back(t.name);
  return names;
}

// The targets that take layout size `taken` (TargetFormatInfo::tp, ...).
std::vector<std::string> TargetsTaking(bool reshard::TargetFormatInfo::*taken) {
  std::vector<std::string> takers;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) {
    if (t.*taken) takers.push_back(t.name);
  }
  return takers;
}

// "consolidated (one state dict ...), hf (...), ...".
std::string TargetsHelp() {
  std::vector<std::string> parts;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) parts.push_back(t.name + " (" + t.help + ")");
  return Join(parts, "; ");
}

std::string OutputsHelp() {
  std::vector<std::string> parts;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) parts.push_back(t.name + ": " + t.output);
  return Join(parts, "; ");
}

// --tp, --pp, --dp, --ep, each naming the targets whose layout it sets.
void AddExportLayout(CLI::App* cmd, reshard::ExportOptions* o) {
  const struct {
    const char* flag;
    const char* what;
    int* value;
    bool reshard::TargetFormatInfo::*taken;
  } sizes[] = {{"--tp", "Target tensor-parallel size", &o->tp, &reshard::TargetFormatInfo::tp},
               {"--pp", "Target pipeline-parallel size", &o->pp, &reshard::TargetFormatInfo::pp},
               {"--dp", "Target data-parallel size", &o->dp, &reshard::TargetFormatInfo::dp},
               {"--ep", "Target expert-parallel size of a model with experts", &o->ep,
                &reshard::TargetFormatInfo::ep}};
  for (const auto& size : sizes) {
    cmd->add_option(size.flag, *size.value, std::string(size.what) + " (" + Join(TargetsTaking(size.taken)) + ")")
        ->check(CLI::Range(1, 1 << 20));
  }
}

// One flag per option name the target formats declare (several may declare
// one), its help saying which targets take it and their defaults.
void AddFormatOptions(CLI::App* cmd, std::map<std::string, std::string>* given) {
  struct Declared {
    reshard::FormatOptionInfo info;
    std::vector<std::string> targets;
    std::map<std::string, std::vector<std::string>> defaults;  // value -> targets
  };
  std::vector<std::string> order;
  std::map<std::string, Declared> declared;
  for (const reshard::TargetFormatInfo& t : reshard::TargetFormats()) {
    for (const reshard::FormatOptionInfo& o : t.options) {
      if (!declared.count(o.name)) order.push_back(o.name);
      Declared& d = declared[o.name];
      d.info = o;
      d.targets.push_back(t.name);
      if (!o.default_value.empty()) d.defaults[o.default_value].push_back(t.name);
    }
  }
  for (const std::string& name : order) {
    const Declared& d = declared[name];
    std::vector<std::string> defaults;
    for (const auto& [value, targets] : d.defaults) {
      defaults.push_back(d.defaults.size() == 1 ? value : value + " for " + Join(targets));
    }
    const std::string help = Join(d.targets) + ": " + d.info.help +
                             (defaults.empty() ? "" : " (default " + Join(defaults, "; ") + ")");
    if (d.info.kind == reshard::FormatOptionInfo::Kind::kFlag) {
      cmd->add_flag_function("--" + name, [given, name](int64_t) { (*given)[name] = "true"; }, help);
      continue;
    }
    CLI::Option* option = cmd->add_option_function<std::string>(
        "--" + name, [given, name](const std::string& value) { (*given)[name] = value; }, help);
    if (d.info.bytes) option->transform(CLI::AsSizeValue(false));
    if (!d.info.choices.empty()) option->check(CLI::IsMember(d.info.choices));
  }
}

void PrintFindings(const std::vector<reshard::Finding>& findings) {
  for (const reshard::Finding& f : findings) {
    const char* tag = f.severity == reshard::Finding::Severity::kError     ? "error"
                      : f.severity == reshard::Finding::Severity::kWarning ? "warning"
                                                                            : "info";
    std::cout << tag << ": " << f.message << "\n";
  }
}

// The notes, or with `quiet` only how many there are (nothing is hidden silently).
void PrintNotes(const std::vector<std::string>& notes, bool quiet) {
  if (!quiet) {
    for (const std::string& n : notes) std::cout << "note: " << Clipped(n) << "\n";
  } else if (!notes.empty()) {
    std::cout << notes.size() << (notes.size() == 1 ? " note" : " notes") << " not shown (-q)\n";
  }
}

// Runs `command` with its progress shown on stderr (unless `quiet`; not on a
// terminal, a line every `log_interval` seconds); the progress line is ended
// before the command's result is printed.
template <typename Options, typename Command>
auto WithProgress(Options o, bool quiet, double log_interval, Command command) {
  ProgressDisplay display(::isatty(STDERR_FILENO) == 1, log_interval);
  if (!quiet) o.progress = display.Callback();
  auto result = command(o);
  display.Finish();
  return result;
}

int RunLint(const std::string& ckpt, const reshard::LintOptions& o, double log_interval) {
  reshard::Result<reshard::LintReport> r = WithProgress(
      o, false, log_interval, [&](const reshard::LintOptions& with) { return reshard::Lint(ckpt, with); });
  if (!r.ok()) return Fail(r.status());
  std::cout << r->summary << "\n";
  for (const std::string& n : r->notes) std::cout << "note: " << Clipped(n) << "\n";
  PrintFindings(r->findings);
  std::vector<std::string> target;
  if (!o.to.empty()) target.push_back(o.to);
  for (const auto& [name, size] : {std::pair<const char*, int>{"TP", o.target_tp}, {"PP", o.target_pp},
                                   {"DP", o.target_dp}, {"EP", o.target_ep}}) {
    if (size > 0) target.push_back(name + (" " + std::to_string(size)));
  }
  const std::string to = target.empty() ? "" : " to " + Join(target);
  const std::string with = to + (r->rule_set.empty() ? "" : " with rule set '" + r->rule_set + "'");
  if (!r->ok()) {
    std::cout << "lint: the checkpoint cannot be converted" << with << "\n";
    return 1;
  }
  std::cout << "lint: ok, the checkpoint can be converted" << with << "\n";
  return 0;
}

int RunInspect(const std::string& ckpt, const reshard::InspectOptions& o) {
  reshard::Result<std::string> r = reshard::Inspect(ckpt, o);
  if (!r.ok()) return Fail(r.status());
  std::cout << *r;
  return 0;
}

// "load 0.4 s, check 0.1 s, ..."
std::string Phases(const reshard::ConvertReport& r) {
  std::string out;
  for (const auto& [name, seconds] : r.phases) {
    char part[64];
    std::snprintf(part, sizeof(part), "%s%s %.2f s", out.empty() ? "" : ", ", name.c_str(), seconds);
    out += part;
  }
  return out;
}

std::string Memory(const reshard::ConvertReport& r) {
  return "budget " + reshard::HumanBytes(r.memory_budget) + ": " + std::to_string(r.threads) +
         " thread(s) x " + reshard::HumanBytes(r.buffer_bytes) + " buffers";
}

void PrintConvertSummary(const std::string& out, const reshard::ConvertReport& r) {
  double write_seconds = 0;
  for (const auto& [name, seconds] : r.phases) {
    if (name == "write") write_seconds = seconds;
  }
  const int64_t rate = write_seconds > 0 ? static_cast<int64_t>(r.bytes_written / write_seconds) : 0;
  std::printf("wrote %lld files, %s (%lld bytes, %lld of tensors) to %s in %.2f s (writing at %s/s)\n",
              static_cast<long long>(r.files), reshard::HumanBytes(r.bytes_written).c_str(),
              static_cast<long long>(r.bytes_written), static_cast<long long>(r.tensor_bytes),
              out.c_str(), r.seconds, reshard::HumanBytes(rate).c_str());
  std::printf("read %s of tensors (%lld bytes, %.2fx the checkpoint's %s); peak memory %s (%s)\n",
              reshard::HumanBytes(r.bytes_read).c_str(),
              static_cast<long long>(r.bytes_read),
              r.checkpoint_bytes > 0 ? static_cast<double>(r.bytes_read) / r.checkpoint_bytes : 0.0,
              reshard::HumanBytes(r.checkpoint_bytes).c_str(), reshard::HumanBytes(r.peak_memory).c_str(),
              Memory(r).c_str());
  std::printf("phases: %s\n", Phases(r).c_str());
}

// convert and export: `run` is reshard::Convert or reshard::Export. Under a
// launcher, rank 0 alone shows progress and prints the summary, both the
// whole job's; the other ranks print only errors.
template <typename Options, typename Run>
int RunWriter(const std::string& in, const std::string& out, Options o, bool quiet, double log_interval,
              Run run) {
  reshard::Result<std::unique_ptr<reshard::Cluster>> cluster = reshard::Cluster::Join();
  if (!cluster.ok()) return Fail(cluster.status());
  o.cluster = cluster->get();
  const bool root = o.cluster->rank() == 0;
  reshard::Result<reshard::ConvertReport> r =
      WithProgress(o, quiet || !root, log_interval, [&](const Options& with) { return run(in, out, with); });
  if (!r.ok()) return Fail(r.status());
  if (!root) return 0;
  if (o.dry_run && !quiet) std::cout << r->plan;
  PrintNotes(r->notes, quiet);
  if (o.dry_run) {
    std::printf("dry run: nothing written; would write %lld files, %lld bytes of tensors (%s; "
                "the checkpoint holds %s); memory about %s (%s); planned in %.2f s\n",
                static_cast<long long>(r->files), static_cast<long long>(r->tensor_bytes),
                reshard::HumanBytes(r->tensor_bytes).c_str(),
                reshard::HumanBytes(r->checkpoint_bytes).c_str(),
                reshard::HumanBytes(r->memory_estimate).c_str(), Memory(*r).c_str(), r->seconds);
    return 0;
  }
  PrintConvertSummary(out, *r);
  return 0;
}

int RunVerify(const std::string& a, const std::string& b, reshard::VerifyOptions o, double log_interval) {
  reshard::Result<std::unique_ptr<reshard::Cluster>> cluster = reshard::Cluster::Join();
  if (!cluster.ok()) return Fail(cluster.status());
  o.cluster = cluster->get();
  const bool root = o.cluster->rank() == 0;
  reshard::Result<reshard::VerifyReport> r =
      WithProgress(o, !root, log_interval,
                   [&](const reshard::VerifyOptions& with) { return reshard::Verify(a, b, with); });
  if (!r.ok()) return Fail(r.status());
  if (!root) return r->same() ? 0 : 1;
  for (const std::string& n : r->notes) std::cout << "note: " << n << "\n";
  for (const std::string& d : r->differences) std::cout << "differs: " << d << "\n";
  std::cout << "verify: " << r->tensors_compared << " tensors, " << r->elements_compared
            << " elements compared; " << (r->same() ? "same model" : "DIFFERENT") << "\n";
  return r->same() ? 0 : 1;
}

int RunVerifyManifest(const std::string& folder, const reshard::CommonOptions& o, double log_interval) {
  reshard::Result<reshard::ManifestReport> r = WithProgress(
      o, false, log_interval, [&](const reshard::CommonOptions& with) { return reshard::VerifyManifest(folder, with); });
  if (!r.ok()) return Fail(r.status());
  if (!r->summary.empty()) std::cout << r->summary << "\n";
  for (const std::string& p : r->problems) std::cout << "problem: " << p << "\n";
  std::cout << "verify: " << r->files_checked << (r->files_checked == 1 ? " file, " : " files, ")
            << reshard::HumanBytes(r->bytes_checked)
            << " checked against the manifest; "
            << (r->ok() ? "as reshard wrote them" + std::string(r->summary.empty() ? "" : ", and consistent")
                        : std::string("DIFFERENT"))
            << "\n";
  return r->ok() ? 0 : 1;
}

int RunRules(const std::string& file) {
  if (!file.empty()) {
    reshard::Result<reshard::RuleSetInfo> r = reshard::CheckRuleFile(file);
    if (!r.ok()) return Fail(r.status());
    std::cout << file << ": ok (rule set '" << r->name << "')\n";
    return 0;
  }
  reshard::Result<std::vector<reshard::RuleSetInfo>> all = reshard::ListRuleSets();
  if (!all.ok()) return Fail(all.status());
  for (const reshard::RuleSetInfo& r : *all) {
    std::cout << r.name << "  " << r.description << "\n    " << r.origin << "\n";
  }
  return 0;
}

// The flags of other checkpoint tools and of Megatron's arguments that a
// reshard option plays the part of.
const std::map<std::string, std::string>& OtherToolsFlags() {
  static const auto* flags = new std::map<std::string, std::string>{
      {"--target-tensor-parallel-size", "--tp"},   {"--target-pipeline-parallel-size", "--pp"},
      {"--target-expert-parallel-size", "--ep"},   {"--target-data-parallel-size", "--dp"},
      {"--tensor-model-parallel-size", "--tp"},    {"--pipeline-model-parallel-size", "--pp"},
      {"--expert-model-parallel-size", "--ep"},    {"--data-parallel-size", "--dp"},
  };
  return *flags;
}

// The subcommand argv names (its first word that is one), and where; null when none.
const CLI::App* GivenSubcommand(const CLI::App& app, int argc, char** argv, int* at) {
  for (int i = 1; i < argc; ++i) {
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (sub->get_name() != argv[i]) continue;
      *at = i;
      return sub;
    }
  }
  return nullptr;
}

// "; did you mean --tp (for --tpp)?" for a flag of argv the subcommand given
// does not take: the option it is a typo of, or the one that plays its part.
std::string FlagHints(const CLI::App& app, int argc, char** argv) {
  int at = 0;
  const CLI::App* cmd = GivenSubcommand(app, argc, argv, &at);
  if (cmd == nullptr) return "";
  std::vector<std::string> names;
  for (const CLI::Option* o : cmd->get_options()) {
    for (const std::string& name : o->get_lnames()) names.push_back("--" + name);
  }
  for (int i = at + 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) continue;
    const std::string flag = arg.substr(0, arg.find('='));
    if (std::find(names.begin(), names.end(), flag) != names.end()) continue;
    const auto known = OtherToolsFlags().find(flag);
    const std::string* typo = known != OtherToolsFlags().end() ? &known->second : reshard::ClosestName(flag, names);
    if (typo != nullptr && std::find(names.begin(), names.end(), *typo) != names.end()) {
      return "; did you mean " + *typo + " (for " + flag + ")?";
    }
  }
  return "";
}

}  // namespace

// The command line as a shell would take it back (arguments with spaces or
// quotes in single quotes), for the output's manifest.
std::string CommandLine(int argc, char** argv) {
  std::string line;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.empty() || arg.find_first_of(" \t'\"\\$") != std::string::npos) {
      std::string quoted = "'";
      for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
      arg = quoted + "'";
    }
    line += (i ? " " : "") + arg;
  }
  return line;
}

int Run(int argc, char** argv) {
  CLI::App app{
      "reshard: reshape training checkpoints between parallel layouts (TP, PP, DP, EP) and formats "
      "(DeepSpeed / Megatron-DeepSpeed, Megatron-Core torch_dist, Megatron-LM, torchtitan, Hugging Face, "
      "DeepSpeed universal, consolidated state dicts), driven by declarative rule files.\n"
      "CHECKPOINT (and INPUT) is a checkpoint folder of any format reshard reads: a DeepSpeed tag folder "
      "(global_stepN), a DeepSpeed universal folder, a Megatron-Core torch_dist or Megatron-LM torch iter_N, "
      "a torchtitan step-N, any PyTorch DCP folder, a Hugging Face transformers folder, a folder of weights "
      "without config.json; or a root whose pointer file (latest, latest_checkpointed_iteration.txt) names one.",
      "reshard"};
  app.set_version_flag("--version", VersionText(), "Print the version, the commit built and the build type");
  app.require_subcommand(1);

  std::string ckpt, out, second, rules_file;
  bool quiet = false;
  double log_interval = ProgressDisplay::kLogInterval;

  reshard::LintOptions lint;
  CLI::App* lint_cmd = app.add_subcommand(
      "lint", "Dry run: check that every tensor is explained by the rules and the layout is sound");
  lint_cmd->add_option("CHECKPOINT", ckpt, "Checkpoint to check")->required();
  AddPreflightOptions(lint_cmd, &lint);
  lint_cmd->add_option("--max-drift-lines", lint.max_drift_lines,
                       "How many replicated-tensor drifts to list");
  lint_cmd->add_option("--tp", lint.target_tp,
                       "Target tensor-parallel size convert will be given (with --pp): lint checks that layout")
      ->check(CLI::Range(1, 4096));
  lint_cmd->add_option("--pp", lint.target_pp, "Target pipeline-parallel size (with --tp)")->check(CLI::Range(1, 4096));
  lint_cmd->add_option("--to", lint.to, "The format convert will write (default: the source's own)");
  lint_cmd->add_option("--dp", lint.target_dp, "Target data-parallel size (default: the source's)")
      ->check(CLI::Range(1, 1 << 20));
  lint_cmd->add_option("--ep", lint.target_ep, "Target expert-parallel size of a MoE checkpoint")
      ->check(CLI::Range(1, 1 << 20));
  lint_cmd->add_flag("--deep", lint.deep,
                     "Also read every byte of every file and check each record's CRC-32, and have "
                     "LibTorch's reader (libreshard_torch_check.so) read every file too");
  AddProgressOption(lint_cmd, &log_interval);

  reshard::InspectOptions inspect;
  CLI::App* inspect_cmd = app.add_subcommand("inspect", "Describe a checkpoint's layout, metadata and tensors");
  inspect_cmd->add_option("CHECKPOINT", ckpt, "Checkpoint to describe")->required();
  AddCommonOptions(inspect_cmd, &inspect);

  reshard::ConvertOptions convert;
  CLI::App* convert_cmd = app.add_subcommand(
      "convert", "Write the checkpoint at another layout (TP / PP / DP / EP), in its own format or another (--to)");
  convert_cmd->add_option("INPUT", ckpt, "Source checkpoint, of any format reshard reads (see reshard --help)")
      ->required();
  convert_cmd->add_option("OUTPUT", out,
                          "deepspeed: the target tag folder, written exactly here (e.g. out/global_step20); with a "
                          "root INPUT (holding 'latest'), the root to write the tag folder and 'latest' into. "
                          "Other formats: as export says")
      ->required();
  convert_cmd->add_option("--to", convert.to,
                          "Target format: " + Join(TargetNames()) +
                              " (default: the source's own; an HF folder converts to deepspeed)");
  // Bounds far above any training run, so that a typo cannot ask for a
  // billion files.
  convert_cmd->add_option("--tp", convert.target_tp, "Target tensor-parallel size (default: the source's)")
      ->check(CLI::Range(1, 4096));
  convert_cmd->add_option("--pp", convert.target_pp, "Target pipeline-parallel size (default: the source's)")
      ->check(CLI::Range(1, 4096));
  convert_cmd->add_option("--dp", convert.target_dp, "Target data-parallel size (default: the source's)")
      ->check(CLI::Range(1, 1 << 20));
  convert_cmd->add_option("--ep", convert.target_ep,
                          "Target expert-parallel size of a model with experts (" +
                              Join(TargetsTaking(&reshard::TargetFormatInfo::ep)) + "; default: the source's)")
      ->check(CLI::Range(1, 1 << 20));
  AddWriteOptions(convert_cmd, &convert, &quiet, &log_interval);
  AddFormatOptions(convert_cmd, &convert.format_options);

  reshard::ExportOptions exporting;
  CLI::App* export_cmd = app.add_subcommand("export", "Write the checkpoint in another format: " + TargetsHelp());
  export_cmd->add_option("INPUT", ckpt, "Source checkpoint, of any format reshard reads (see reshard --help)")
      ->required();
  export_cmd->add_option("OUTPUT", out, "Folder to write: " + OutputsHelp())->required();
  export_cmd->add_option("--to", exporting.to, "Target format: " + Join(TargetNames()))->required();
  AddExportLayout(export_cmd, &exporting);
  AddFormatOptions(export_cmd, &exporting.format_options);
  AddWriteOptions(export_cmd, &exporting, &quiet, &log_interval);

  reshard::VerifyOptions verify;
  CLI::App* verify_cmd = app.add_subcommand(
      "verify",
      "Check that two checkpoints hold the same model, tensor by tensor, whatever their layouts; "
      "with one folder, check an output of reshard against the manifest written into it");
  verify_cmd->add_option("A", ckpt, "First checkpoint (alone: an output of reshard)")->required();
  verify_cmd->add_option("B", second, "Second checkpoint");
  AddCommonOptions(verify_cmd, &verify);
  verify_cmd->add_option("--rules-b", verify.rules_b, "Rule set for B (default: as for A)");
  verify_cmd->add_flag("--weights-only", verify.weights_only,
                       "Compare the weights only: neither side's optimizer state is read");
  verify_cmd->add_flag("--deep", verify.deep,
                       "Also read every byte of both checkpoints and check each record's CRC-32");
  verify_cmd->add_option("--max-memory", verify.max_memory,
                         "Resident memory the comparison may use, e.g. 512MiB (default 1GiB)")
      ->transform(CLI::AsSizeValue(false));
  std::string verify_replicated = "first";
  verify_cmd->add_option("--replicated", verify_replicated,
                         "Merge TP replicas before comparing: first (TP rank 0) or average")
      ->check(CLI::IsMember({"average", "first"}));
  AddProgressOption(verify_cmd, &log_interval);

  CLI::App* rules_cmd = app.add_subcommand(
      "rules", "List the built-in rule sets, or validate a rule file");
  rules_cmd->add_option("FILE", rules_file, "Rule file to validate");
  for (CLI::App* cmd : app.get_subcommands([](CLI::App*) { return true; })) {
    cmd->add_flag("-v,--verbose", verbose, "Print every message whole (errors and notes longer than two lines are cut)");
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    int at = 0;
    const CLI::App* cmd = GivenSubcommand(app, argc, argv, &at);
    std::cerr << "reshard: error: " << e.what() << FlagHints(app, argc, argv) << " (see reshard "
              << (cmd != nullptr ? cmd->get_name() + " " : "") << "--help)\n";
    return 2;
  }

  if (lint_cmd->parsed()) return RunLint(ckpt, lint, log_interval);
  if (inspect_cmd->parsed()) return RunInspect(ckpt, inspect);
  convert.command = exporting.command = CommandLine(argc, argv);
  if (convert_cmd->parsed()) return RunWriter(ckpt, out, convert, quiet, log_interval, reshard::Convert);
  if (export_cmd->parsed()) return RunWriter(ckpt, out, exporting, quiet, log_interval, reshard::Export);
  if (verify_cmd->parsed()) {
    verify.replicated = verify_replicated == "average" ? reshard::ReplicatedPolicy::kAverage
                                                       : reshard::ReplicatedPolicy::kFirst;
    if (second.empty()) return RunVerifyManifest(ckpt, verify, log_interval);
    return RunVerify(ckpt, second, verify, log_interval);
  }
  return RunRules(rules_file);
}

int main(int argc, char** argv) {
  // The engine reports problems as Status; anything thrown past it is a bug
  // or the system failing under it, and still gets one line, not an abort.
  reshard::CleanUpOnSignals();
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "reshard: error: " << e.what() << " (an internal failure; please report it)\n";
  } catch (...) {
    std::cerr << "reshard: error: an unknown internal failure; please report it\n";
  }
  return 3;
}
