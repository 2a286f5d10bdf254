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
#include <set>
#include <sstream>

#include "api/common.h"
#include "container/record_crc.h"
#include "container/mapped_file.h"
#include "exec/executor.h"
#include "exec/memory_budget.h"
#include "formats/registry.h"
#include "reshard/cluster.h"
#include "util/shape.h"

namespace reshard {
namespace {

// What comparing one pair found.
struct Outcome {
  int64_t differing = 0;
  double max_diff = 0;
};

// Compares `n` elements of two producers, half of the buffer for each side.
Status CompareStreams(const FullTensor& a, const FullTensor& b, int64_t n,
                      JobContext& ctx, Outcome* out) {
  const int es = ElementSize(a.dtype);
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(ctx.buffer.size()) / 2 / es);
  if (ctx.buffer.size() < static_cast<size_t>(2 * chunk * es)) ctx.buffer.resize(2 * chunk * es);
  uint8_t* da = ctx.buffer.data();
  uint8_t* db = da + chunk * es;
  for (int64_t at = 0; at < n; at += chunk) {
    const int64_t len = std::min(chunk, n - at);
    RESHARD_RETURN_IF_ERROR(a.produce(at * es, len * es, da));
    RESHARD_RETURN_IF_ERROR(b.produce(at * es, len * es, db));
    ctx.done(len * es);
    if (std::memcmp(da, db, static_cast<size_t>(len) * es) == 0) continue;
    for (int64_t i = 0; i < len; ++i) {
      if (std::memcmp(da + i * es, db + i * es, es) == 0) continue;
      ++out->differing;
      if (IsFloatingPoint(a.dtype)) {
        out->max_diff = std::max(out->max_diff, std::abs(LoadAsDouble(a.dtype, da + i * es) -
                                                         LoadAsDouble(a.dtype, db + i * es)));
      }
    }
  }
  return Status::Ok();
}

// The shape both sides are compared over: vocabulary tensors over the rows both have.
std::vector<int64_t> ComparedShape(const FullTensor& a, const FullTensor& other) {
  std::vector<int64_t> shape = a.shape;
  if (a.vocab && !shape.empty() && !other.shape.empty()) shape[0] = std::min(shape[0], other.shape[0]);
  return shape;
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
  Comparison(std::vector<FullTensor> a, std::vector<FullTensor> b)
      : a_(std::move(a)), b_(std::move(b)) {}

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
      const std::vector<int64_t> shape = ComparedShape(a, b);
      if (a.dtype != b.dtype || shape != ComparedShape(b, a)) {
        lines_.push_back({i, a.Label() + ": " + DTypeName(a.dtype) + " vs " + DTypeName(b.dtype) +
                                 ", shapes differ"});
        continue;
      }
      const int64_t n = ShapeNumel(shape);
      ++report->tensors_compared;
      report->elements_compared += n;
      compared_.push_back(i);
      jobs.push_back({a.name, n * ElementSize(a.dtype), [this, i, &b, n](JobContext& ctx) {
                        return CompareStreams(a_[i], b, n, ctx, &outcomes_[i]);
                      }});
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
  std::vector<Outcome> outcomes_;          // by index into a_
  std::vector<size_t> compared_;
  std::set<std::string> matched_;
  std::vector<std::pair<size_t, std::string>> lines_;
  std::vector<std::string> only_b_;
};

void CompareMetadata(const SourceCheckpoint& a, const SourceCheckpoint& b, VerifyReport* report) {
  if (a.info().iteration != b.info().iteration) {
    report->differences.push_back("iteration: " + std::to_string(a.info().iteration) + " vs " +
                                  std::to_string(b.info().iteration));
  }
  for (const SourceCheckpoint* side : {&a, &b}) {
    if (side->info().records_run_state) continue;
    report->notes.push_back(std::string(side == &a ? "A" : "B") + "'s format keeps no learning-rate scheduler or "
                            "sample counters: lr_scheduler, global_samples and skipped_steps not compared");
    return;
  }
  for (const char* key : {"lr_scheduler", "global_samples", "skipped_steps"}) {
    const Value* va = Find(a.info().metadata, key);
    const Value* vb = Find(b.info().metadata, key);
    const std::string sa = va ? va->DebugString(100000) : "(absent)";
    const std::string sb = vb ? vb->DebugString(100000) : "(absent)";
    if (sa != sb) report->differences.push_back(std::string(key) + " differs");
  }
}

Status RunJobs(std::vector<Job>& jobs, const VerifyOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(MemoryBudget memory,
                           MemoryBudget::Plan(options.max_memory, ThreadCount(options.threads)));
  ExecuteOptions exec;
  exec.threads = memory.threads;
  exec.buffer_bytes = memory.buffer_bytes;
  exec.progress = options.progress;
  return Execute(jobs, exec);
}

// Runs this process's share of the comparisons; afterwards every process
// of the cluster knows every pair's outcome.
Status RunComparison(Comparison* comparison, std::vector<Job> all, const VerifyOptions& options) {
  Cluster* cluster = options.cluster;
  if (cluster == nullptr || cluster->size() == 1) return RunJobs(all, options);
  std::vector<Job> mine = JobsOfRank(std::move(all), cluster->rank(), cluster->size());
  RESHARD_RETURN_IF_ERROR(cluster->AllOk(RunJobs(mine, options)));
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
  if (a->info().kind != b->info().kind) {
    return Status::InvalidInput("A is a " + a->info().kind + " checkpoint and B a " + b->info().kind +
                                " one; reshard compares checkpoints of the same kind");
  }
  for (const auto& [src, path] : {std::pair{a.get(), a_path}, std::pair{b.get(), b_path}}) {
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
    for (const std::string& note : src->info().notes) report.notes.push_back(side + note);
  }
  std::atomic<int64_t> read{0};
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> ta, a->FullTensors(options.replicated, &read));
  RESHARD_ASSIGN_OR_RETURN(std::vector<FullTensor> tb, b->FullTensors(options.replicated, &read));
  Comparison comparison(std::move(ta), std::move(tb));
  RESHARD_RETURN_IF_ERROR(RunComparison(&comparison, comparison.Jobs(&report), options));
  RESHARD_RETURN_IF_ERROR(CheckMappedFilesUnchanged());
  RESHARD_RETURN_IF_ERROR(CheckReadRecords());
  comparison.Report(&report);
  CompareMetadata(*a, *b, &report);
  if (a->info().vocab_rows != b->info().vocab_rows) {
    report.notes.push_back("vocabulary rows compared up to " +
                           std::to_string(std::min(a->info().vocab_rows, b->info().vocab_rows)) +
                           " (A has " + std::to_string(a->info().vocab_rows) + ", B " +
                           std::to_string(b->info().vocab_rows) + ")");
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
