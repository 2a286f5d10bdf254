// reshard::Verify: are two checkpoints the same model, whatever their layouts?
#include <cstring>

#include "api/common.h"
#include "exec/materialize.h"
#include "logical/drift.h"
#include "plan/plan.h"

namespace reshard {
namespace {

struct TensorRef {
  int layer_index;
  int tensor_index;
};

// Tensors by "<layer id>/<key>", in order.
std::vector<std::pair<std::string, TensorRef>> Index(const LogicalCheckpoint& ckpt) {
  std::vector<std::pair<std::string, TensorRef>> index;
  for (size_t li = 0; li < ckpt.layers.size(); ++li) {
    for (size_t ti = 0; ti < ckpt.layers[li].tensors.size(); ++ti) {
      index.push_back({TensorLabel(ckpt.layers[li].id, ckpt.layers[li].tensors[ti].key),
                       {static_cast<int>(li), static_cast<int>(ti)}});
    }
  }
  return index;
}

const TensorRef* Lookup(const std::vector<std::pair<std::string, TensorRef>>& index,
                        const std::string& label) {
  for (const auto& [l, ref] : index) {
    if (l == label) return &ref;
  }
  return nullptr;
}

// Compares the whole logical tensors; vocabulary tensors over the rows both have.
void CompareTensor(const LogicalCheckpoint& a, const TensorRef& ra, const LogicalCheckpoint& b,
                   const TensorRef& rb, const std::string& label, ReplicatedPolicy replicated,
                   VerifyReport* report) {
  const LogicalTensor& ta = a.layers[ra.layer_index].tensors[ra.tensor_index];
  const LogicalTensor& tb = b.layers[rb.layer_index].tensors[rb.tensor_index];
  std::vector<int64_t> sa = ta.full_shape, sb = tb.full_shape;
  const bool vocab = ta.rule->policy == ParamRule::Policy::kVocab;
  if (vocab && !sa.empty() && !sb.empty()) sa[0] = sb[0] = std::min(sa[0], sb[0]);
  if (ta.dtype != tb.dtype || sa != sb) {
    report->differences.push_back(label + ": " + DTypeName(ta.dtype) + " vs " +
                                  DTypeName(tb.dtype) + ", shapes differ");
    return;
  }
  std::vector<uint8_t> da, db;
  MaterializeTensor(ta, PlanFullTensor(a, ra.layer_index, ra.tensor_index, replicated), &da);
  MaterializeTensor(tb, PlanFullTensor(b, rb.layer_index, rb.tensor_index, replicated), &db);
  const int es = ElementSize(ta.dtype);
  int64_t n = 1;
  for (int64_t d : sa) n *= d;
  ++report->tensors_compared;
  report->elements_compared += n;
  int64_t differing = 0;
  double max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(da.data() + i * es, db.data() + i * es, es) == 0) continue;
    ++differing;
    if (IsFloatingPoint(ta.dtype)) {
      max_diff = std::max(max_diff, std::abs(LoadAsDouble(ta.dtype, da.data() + i * es) -
                                             LoadAsDouble(ta.dtype, db.data() + i * es)));
    }
  }
  if (differing > 0) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), ": %lld of %lld elements differ, max |diff| %.3g",
                  static_cast<long long>(differing), static_cast<long long>(n), max_diff);
    report->differences.push_back(label + buf);
  }
}

void CompareMetadata(const LogicalCheckpoint& a, const LogicalCheckpoint& b, VerifyReport* report) {
  if (a.iteration != b.iteration) {
    report->differences.push_back("iteration: " + std::to_string(a.iteration) + " vs " +
                                  std::to_string(b.iteration));
  }
  for (const char* key : {"lr_scheduler", "global_samples", "skipped_steps"}) {
    const Value* va = Find(a.metadata[0], key);
    const Value* vb = Find(b.metadata[0], key);
    const std::string sa = va ? va->DebugString(100000) : "(absent)";
    const std::string sb = vb ? vb->DebugString(100000) : "(absent)";
    if (sa != sb) report->differences.push_back(std::string(key) + " differs");
  }
}

}  // namespace

Result<VerifyReport> Verify(const std::string& a_path, const std::string& b_path,
                            const VerifyOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> a, LoadForCommand(a_path, options));
  CommonOptions b_options = options;
  if (!options.rules_b.empty()) b_options.rules = options.rules_b;
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> b, LoadForCommand(b_path, b_options));
  RESHARD_RETURN_IF_ERROR(a->FirstError().WithContext(a_path));
  RESHARD_RETURN_IF_ERROR(b->FirstError().WithContext(b_path));
  VerifyReport report;
  report.notes.push_back("A: " + LayoutSummary(*a));
  report.notes.push_back("B: " + LayoutSummary(*b));
  const auto index_a = Index(*a), index_b = Index(*b);
  for (const auto& [label, ref] : index_a) {
    const TensorRef* other = Lookup(index_b, label);
    if (other == nullptr) {
      report.differences.push_back(label + ": only in A");
      continue;
    }
    CompareTensor(*a, ref, *b, *other, label, options.replicated, &report);
  }
  for (const auto& [label, ref] : index_b) {
    if (Lookup(index_a, label) == nullptr) report.differences.push_back(label + ": only in B");
  }
  CompareMetadata(*a, *b, &report);
  if (a->vocab.padded_rows != b->vocab.padded_rows) {
    report.notes.push_back("vocabulary rows compared up to " +
                           std::to_string(std::min(a->vocab.padded_rows, b->vocab.padded_rows)) +
                           " (A has " + std::to_string(a->vocab.padded_rows) + ", B " +
                           std::to_string(b->vocab.padded_rows) + ")");
  }
  for (const Drift& d : MeasureDrift(*b)) {
    report.notes.push_back("B's replicas differ: " + DescribeDrift(*b, d));
  }
  if (static_cast<int>(report.differences.size()) > options.max_difference_lines) {
    const size_t more = report.differences.size() - options.max_difference_lines;
    report.differences.resize(options.max_difference_lines);
    report.differences.push_back("... and " + std::to_string(more) + " more");
  }
  return report;
}

}  // namespace reshard
