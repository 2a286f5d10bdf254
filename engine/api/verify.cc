// reshard::Verify: are two checkpoints the same model, whatever their layouts?
//
// Each side lists its tensors by canonical name, each produced a range at a
// time from its shards; every pair is compared element by element through
// the executor, a buffer at a time, so memory stays under --max-memory
// whatever the tensors' size. Under MPI the processes share the pairs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "api/cluster_progress.h"
#include "api/common.h"
#include "container/record_crc.h"
#include "container/mapped_file.h"
#include "exec/executor.h"
#include "exec/memory_budget.h"
#include "formats/registry.h"
#include "formats/state_dict.h"
#include "reshard/cluster.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// What comparing one pair found.
struct Outcome {
  int64_t differing = 0;
  double max_diff = 0;
};

// Compares `n` elements of two producers, half of the buffer for each side.
Status CompareStreams(DType dtype, const ByteProducer& a, const ByteProducer& b, int64_t n,
                      JobContext& ctx, Outcome* out) {
  const int es = ElementSize(dtype);
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(ctx.buffer.size()) / 2 / es);
  if (ctx.buffer.size() < static_cast<size_t>(2 * chunk * es)) ctx.buffer.resize(2 * chunk * es);
  uint8_t* da = ctx.buffer.data();
  uint8_t* db = da + chunk * es;
  for (int64_t at = 0; at < n; at += chunk) {
    const int64_t len = std::min(chunk, n - at);
    RESHARD_RETURN_IF_ERROR(a(at * es, len * es, da));
    RESHARD_RETURN_IF_ERROR(b(at * es, len * es, db));
    ctx.done(len * es);
    if (std::memcmp(da, db, static_cast<size_t>(len) * es) == 0) continue;
    for (int64_t i = 0; i < len; ++i) {
      if (std::memcmp(da + i * es, db + i * es, es) == 0) continue;
      ++out->differing;
      if (IsFloatingPoint(dtype)) {
        out->max_diff = std::max(out->max_diff, std::abs(LoadAsDouble(dtype, da + i * es) -
                                                         LoadAsDouble(dtype, db + i * es)));
      }
    }
  }
  return Status::Ok();
}

// The shape both sides are compared over: vocabulary tensors over the rows
// both have, and no further than the true vocabulary where a side records it
// (the padding rows are no part of the model: a TP change re-makes them).
std::vector<int64_t> ComparedShape(const FullTensor& a, const FullTensor& other, std::optional<int64_t> true_rows) {
  std::vector<int64_t> shape = a.shape;
  if (a.vocab && !shape.empty() && !other.shape.empty()) {
    shape[0] = std::min(shape[0], other.shape[0]);
    if (true_rows) shape[0] = std::min(shape[0], *true_rows);
  }
  return shape;
}

// The true vocabulary size, where either side records it.
std::optional<int64_t> TrueVocabRows(const SourceInfo& a, const SourceInfo& b) {
  if (a.vocab_size && b.vocab_size) return std::min(*a.vocab_size, *b.vocab_size);
  return a.vocab_size ? a.vocab_size : b.vocab_size;
}

// The dtype two tensors are compared at: their own; the narrower of two
// floating-point dtypes of different widths (a 16-bit run's weights against
// another format's fp32 masters); none for any other pair.
std::optional<DType> ComparedDType(DType a, DType b) {
  if (a == b) return a;
  if (!IsFloatingPoint(a) || !IsFloatingPoint(b) || ElementSize(a) == ElementSize(b)) return std::nullopt;
  return ElementSize(a) < ElementSize(b) ? a : b;
}

// The bytes of `t` as elements of `dtype`.
ByteProducer As(const FullTensor& t, DType dtype) {
  return t.dtype == dtype ? t.produce : CastBytes(t.produce, t.dtype, dtype);
}

std::set<std::string> Sections(const std::vector<FullTensor>& tensors) {
  std::set<std::string> sections;
  for (const FullTensor& t : tensors) sections.insert(t.section);
  return sections;
}

// One compare job per pair both sides have; the rest are differences or,
// for a section only one side has, a note.
class Comparison {
 public:
  Comparison(std::vector<FullTensor> a, std::vector<FullTensor> b, std::optional<int64_t> true_rows)
      : a_(std::move(a)), b_(std::move(b)), true_rows_(true_rows) {}

  std::vector<Job> Jobs(VerifyReport* report) {
    const std::set<std::string> sa = Sections(a_), sb = Sections(b_);
    for (const std::string& s : sa) {
      if (!sb.count(s)) report->notes.push_back(s + " not compared: only A has " + s + " state");
    }
    for (const std::string& s : sb) {
      if (!sa.count(s)) report->notes.push_back(s + " not compared: only B has " + s + " state");
    }
    std::map<std::string, const FullTensor*> by_name;
    for (const FullTensor& t : b_) by_name[t.name] = &t;
    std::vector<Job> jobs;
    outcomes_.resize(a_.size());
    for (size_t i = 0; i < a_.size(); ++i) {
      const FullTensor& a = a_[i];
      if (!sb.count(a.section)) continue;
      auto other = by_name.find(a.name);
      if (other == by_name.end()) {
        lines_.push_back({i, a.Label() + ": only in A"});
        continue;
      }
      const FullTensor& b = *other->second;
      matched_.insert(b.name);
      const std::vector<int64_t> shape = ComparedShape(a, b, true_rows_);
      if (shape != ComparedShape(b, a, true_rows_)) {
        lines_.push_back({i, a.Label() + ": shapes differ, " + ShapeString(a.shape) + " vs " + ShapeString(b.shape)});
        continue;
      }
      const std::optional<DType> dtype = ComparedDType(a.dtype, b.dtype);
      if (!dtype) {
        lines_.push_back({i, a.Label() + ": " + DTypeName(a.dtype) + " vs " + DTypeName(b.dtype)});
        continue;
      }
      if (*dtype != a.dtype || *dtype != b.dtype) ++cast_[{a.dtype, b.dtype}];
      const int64_t n = ShapeNumel(shape);
      ++report->tensors_compared;
      report->elements_compared += n;
      compared_.push_back(i);
      jobs.push_back({a.name, n * ElementSize(*dtype),
                      [this, i, dtype = *dtype, pa = As(a, *dtype), pb = As(b, *dtype), n](JobContext& ctx) {
                        return CompareStreams(dtype, pa, pb, n, ctx, &outcomes_[i]);
                      }});
    }
    for (const auto& [dtypes, count] : cast_) {
      report->notes.push_back(std::to_string(count) + " tensor(s) held as " + DTypeName(dtypes.first) + " in A and " +
                              DTypeName(dtypes.second) + " in B compared at " +
                              DTypeName(*ComparedDType(dtypes.first, dtypes.second)) +
                              ": the wider one rounded to it, as a run makes its 16-bit weights of its fp32 masters");
    }
    for (const FullTensor& b : b_) {
      if (sa.count(b.section) && !matched_.count(b.name)) only_b_.push_back(b.Label() + ": only in B");
    }
    return jobs;
  }

  // What this process's jobs found, for the other processes.
  std::string EncodeOutcomes() const {
    std::string out;
    for (size_t i : compared_) {
      if (outcomes_[i].differing == 0) continue;
      char line[96];
      std::snprintf(line, sizeof(line), "%zu %lld %a\n", i,
                    static_cast<long long>(outcomes_[i].differing), outcomes_[i].max_diff);
      out += line;
    }
    return out;
  }

  // Adds what another process's jobs found (each pair ran in one process).
  Status MergeOutcomes(const std::string& encoded) {
    std::istringstream in(encoded);
    std::string line;
    while (std::getline(in, line)) {
      size_t i = 0;
      long long differing = 0;
      double max_diff = 0;
      if (std::sscanf(line.c_str(), "%zu %lld %la", &i, &differing, &max_diff) != 3 ||
          i >= outcomes_.size()) {
        return Status::Internal("a verify process sent an unreadable outcome: " + line);
      }
      outcomes_[i].differing += differing;
      outcomes_[i].max_diff = std::max(outcomes_[i].max_diff, max_diff);
    }
    return Status::Ok();
  }

  // The differences in A's order, after the jobs ran.
  void Report(VerifyReport* report) {
    for (size_t i : compared_) {
      const Outcome& o = outcomes_[i];
      if (o.differing == 0) continue;
      char buf[128];
      std::snprintf(buf, sizeof(buf), ": %lld of %lld elements differ, max |diff| %.3g",
                    static_cast<long long>(o.differing),
                    static_cast<long long>(ShapeNumel(a_[i].shape)), o.max_diff);
      lines_.push_back({i, a_[i].Label() + buf});
    }
    std::stable_sort(lines_.begin(), lines_.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    for (auto& [i, line] : lines_) report->differences.push_back(std::move(line));
    for (std::string& line : only_b_) report->differences.push_back(std::move(line));
  }

 private:
  std::vector<FullTensor> a_, b_;
  std::optional<int64_t> true_rows_;
  std::vector<Outcome> outcomes_;          // by index into a_
  std::vector<size_t> compared_;
  std::set<std::string> matched_;
  std::vector<std::pair<size_t, std::string>> lines_;
  std::vector<std::string> only_b_;
  std::map<std::pair<DType, DType>, int> cast_;  // tensors compared at the narrower of their dtypes
};

// One item of run state as a side records it, for comparing.
std::string RunStateText(const SourceCheckpoint& side, const std::string& key) {
  if (key == kIterationKey) return std::to_string(side.info().iteration);
  const Value* v = Find(side.info().metadata, key);
  return v ? v->DebugString(100000) : "(absent)";
}

// The run state both sides record is compared; what only one records is
// named in a note (a weights-only format's model is the same model).
void CompareRunState(const SourceCheckpoint& a, const SourceCheckpoint& b, VerifyReport* report) {
  std::vector<std::string> only_a, only_b;
  for (const char* key : kRunStateKeys) {
    const bool in_a = a.info().run_state.count(key) > 0, in_b = b.info().run_state.count(key) > 0;
    if (in_a && !in_b) only_a.push_back(key);
    if (in_b && !in_a) only_b.push_back(key);
    if (!in_a || !in_b) continue;
    const std::string sa = RunStateText(a, key), sb = RunStateText(b, key);
    if (sa == sb) continue;
    report->differences.push_back(key == std::string(kIterationKey) ? std::string(key) + ": " + sa + " vs " + sb
                                                                    : std::string(key) + " differs");
  }
  for (const auto& [keys, side, other] : {std::tuple{&only_a, "A", &b}, std::tuple{&only_b, "B", &a}}) {
    if (keys->empty()) continue;
    report->notes.push_back(Join(*keys, ", ") + " not compared: only " + side + " records " +
                            (keys->size() == 1 ? "it" : "them") + " (" + other->info().format + " does not)");
  }
}

constexpr const char* kUnit = "tensors";

Status RunJobs(std::vector<Job>& jobs, const VerifyOptions& options, ProgressCallback progress) {
  RESHARD_ASSIGN_OR_RETURN(MemoryBudget memory,
                           MemoryBudget::Plan(options.max_memory, ThreadCount(options.threads)));
  ExecuteOptions exec;
  exec.threads = memory.threads;
  exec.buffer_bytes = memory.buffer_bytes;
  exec.progress = std::move(progress);
  exec.unit = kUnit;
  return Execute(jobs, exec);
}

// Runs this process's share of the comparisons, its progress shown as the
// whole job's on rank 0; afterwards every process of the cluster knows every
// pair's outcome.
Status RunComparison(Comparison* comparison, std::vector<Job> all, const VerifyOptions& options,
                     VerifyReport* report) {
  Cluster* cluster = options.cluster;
  if (cluster == nullptr || cluster->size() == 1) return RunJobs(all, options, options.progress);
  std::vector<Job> mine = JobsOfRank(std::move(all), cluster->rank(), cluster->size());
  ClusterProgress progress(cluster, options.progress);
  if (!progress.note().empty()) report->notes.push_back(progress.note());
  Status ran = progress.Begin(ProgressBefore(mine, kUnit));
  if (ran.ok()) ran = RunJobs(mine, options, progress.Callback());
  progress.Finish();
  RESHARD_RETURN_IF_ERROR(cluster->AllOk(ran));
  RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> found,
                           cluster->AllGather(comparison->EncodeOutcomes()));
  for (int r = 0; r < cluster->size(); ++r) {
    if (r != cluster->rank()) RESHARD_RETURN_IF_ERROR(comparison->MergeOutcomes(found[r]));
  }
  return Status::Ok();
}

}  // namespace

Result<VerifyReport> Verify(const std::string& a_path, const std::string& b_path,
                            const VerifyOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> a, OpenCheckpoint(a_path, options));
  CommonOptions b_options = options;
  if (!options.rules_b.empty()) b_options.rules = options.rules_b;
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> b, OpenCheckpoint(b_path, b_options));
  for (const auto& [src, path] : {std::pair{a.get(), a_path}, std::pair{b.get(), b_path}}) {
    // Every value a side lacks in one refusal, before the first of its reading errors.
    Status given = CheckNoneMissing(src->MissingValues(std::nullopt, std::nullopt), "the comparison");
    if (!given.ok()) return given.WithContext(path);
    for (const Finding& f : src->info().findings) {
      if (f.severity == Finding::Severity::kError) return Status::InvalidInput(f.message).WithContext(path);
    }
  }
  if (options.deep) {
    for (const auto& [src, path] : {std::pair{a.get(), a_path}, std::pair{b.get(), b_path}}) {
      std::vector<std::string> damaged;
      RESHARD_RETURN_IF_ERROR(CheckRecordCrcs(*src, ThreadCount(options.threads), /*torch=*/nullptr, nullptr, &damaged));
      if (!damaged.empty()) return Status::InvalidInput(damaged.front());
    }
  }
  VerifyReport report;
  for (const auto& [side, src] : {std::pair{"A: ", a.get()}, std::pair{"B: ", b.get()}}) {
    report.notes.push_back(side + src->info().summary);
    const CommonOptions& opened = src == a.get() ? static_cast<const CommonOptions&>(options) : b_options;
    for (const std::string& note : OpenNotes(*src, opened)) report.notes.push_back(side + note);
  }
  std::atomic<int64_t> read{0};
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> ta, a->FullTensors(options.replicated, &read));
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> tb, b->FullTensors(options.replicated, &read));
  // Each side opened weights-only read no optimizer state (or refused, where its weights are its masters).
  if (options.weights_only) report.notes.push_back("optimizer state not compared (--weights-only)");
  const std::optional<int64_t> true_rows = TrueVocabRows(a->info(), b->info());
  Comparison comparison(std::move(ta), std::move(tb), true_rows);
  RESHARD_RETURN_IF_ERROR(RunComparison(&comparison, comparison.Jobs(&report), options, &report));
  RESHARD_RETURN_IF_ERROR(CheckMappedFilesUnchanged());
  RESHARD_RETURN_IF_ERROR(CheckReadRecords());
  comparison.Report(&report);
  CompareRunState(*a, *b, &report);
  // A side without rules (a state dict) does not say which rows are vocabulary.
  const int64_t rows_a = a->info().vocab_rows, rows_b = b->info().vocab_rows;
  const int64_t compared_rows = std::min({rows_a, rows_b, true_rows.value_or(rows_a)});
  if (rows_a > 0 && rows_b > 0 && compared_rows < std::max(rows_a, rows_b)) {
    report.notes.push_back("vocabulary rows compared up to " + std::to_string(compared_rows) +
                           (compared_rows < std::min(rows_a, rows_b) ? ", the true vocabulary" : "") + " (A has " +
                           std::to_string(rows_a) + ", B " + std::to_string(rows_b) + ")");
  }
  for (const std::string& note : b->VerifyNotes()) report.notes.push_back("B's " + note);
  if (static_cast<int>(report.differences.size()) > options.max_difference_lines) {
    const size_t more = report.differences.size() - options.max_difference_lines;
    report.differences.resize(options.max_difference_lines);
    report.differences.push_back("... and " + std::to_string(more) + " more");
  }
  return report;
}

}  // namespace reshard
