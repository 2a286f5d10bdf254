// reshard::Verify: are two checkpoints the same model, whatever their layouts?
#include <algorithm>
#include <cstring>
#include <map>

#include "api/common.h"
#include "logical/drift.h"
#include "formats/deepspeed/state_tensor.h"
#include "plan/plan.h"
#include "formats/deepspeed/zero3_checkpoint.h"

namespace reshard {
namespace {

// One tensor of one checkpoint: its place (for its plan) and its data, which
// for optimizer state are gathered shards shaped like the weight.
struct Side {
  const LogicalCheckpoint& ckpt;
  int layer_index;
  int tensor_index;
  const LogicalTensor& data;
  // For weights: the checkpoint's optimizer state, whose averaged masters give
  // averaged replicated weights exactly as convert writes them. May be null.
  const SourceOptimizer* masters = nullptr;
};

// The whole logical tensor of one side, replicas merged by `replicated`.
Status MaterializeWhole(const Side& side, ReplicatedPolicy replicated, std::vector<uint8_t>* out) {
  const TensorPlan plan = PlanFullTensor(side.ckpt, side.layer_index, side.tensor_index, replicated);
  return MaterializeWeight(side.ckpt, side.masters, side.data, plan, out);
}

// "<layer>/<key>" -> (layer index, tensor index).
std::map<std::string, std::pair<int, int>> Index(const LogicalCheckpoint& ckpt) {
  std::map<std::string, std::pair<int, int>> index;
  for (size_t li = 0; li < ckpt.layers.size(); ++li) {
    for (size_t ti = 0; ti < ckpt.layers[li].tensors.size(); ++ti) {
      index[TensorLabel(ckpt.layers[li].id, ckpt.layers[li].tensors[ti].key)] = {
          static_cast<int>(li), static_cast<int>(ti)};
    }
  }
  return index;
}

// Compares two whole logical tensors; vocabulary tensors over the rows both have.
Status CompareWhole(const Side& a, const Side& b, const std::string& label,
                  ReplicatedPolicy replicated, VerifyReport* report) {
  std::vector<int64_t> sa = a.data.full_shape, sb = b.data.full_shape;
  if (a.data.rule->policy == ParamRule::Policy::kVocab && !sa.empty() && !sb.empty()) {
    sa[0] = sb[0] = std::min(sa[0], sb[0]);
  }
  if (a.data.dtype != b.data.dtype || sa != sb) {
    report->differences.push_back(label + ": " + DTypeName(a.data.dtype) + " vs " +
                                  DTypeName(b.data.dtype) + ", shapes differ");
    return Status::Ok();
  }
  std::vector<uint8_t> da, db;
  RESHARD_RETURN_IF_ERROR(MaterializeWhole(a, replicated, &da));
  RESHARD_RETURN_IF_ERROR(MaterializeWhole(b, replicated, &db));
  const DType dtype = a.data.dtype;
  const int es = ElementSize(dtype);
  int64_t n = 1;
  for (int64_t d : sa) n *= d;
  ++report->tensors_compared;
  report->elements_compared += n;
  int64_t differing = 0;
  double max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(da.data() + i * es, db.data() + i * es, es) == 0) continue;
    ++differing;
    if (IsFloatingPoint(dtype)) {
      max_diff = std::max(max_diff, std::abs(LoadAsDouble(dtype, da.data() + i * es) -
                                             LoadAsDouble(dtype, db.data() + i * es)));
    }
  }
  if (differing > 0) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), ": %lld of %lld elements differ, max |diff| %.3g",
                  static_cast<long long>(differing), static_cast<long long>(n), max_diff);
    report->differences.push_back(label + buf);
  }
  return Status::Ok();
}

Status CompareWeights(const LogicalCheckpoint& a, const SourceOptimizer* masters_a,
                      const LogicalCheckpoint& b, const SourceOptimizer* masters_b,
                      ReplicatedPolicy replicated, VerifyReport* report) {
  const auto index_a = Index(a), index_b = Index(b);
  for (const auto& [label, ref] : index_a) {
    auto other = index_b.find(label);
    if (other == index_b.end()) {
      report->differences.push_back(label + ": only in A");
      continue;
    }
    const auto [ali, ati] = ref;
    const auto [bli, bti] = other->second;
    RESHARD_RETURN_IF_ERROR(CompareWhole({a, ali, ati, a.layers[ali].tensors[ati], masters_a},
                                         {b, bli, bti, b.layers[bli].tensors[bti], masters_b},
                                         label, replicated, report));
  }
  for (const auto& [label, ref] : index_b) {
    if (!index_a.count(label)) report->differences.push_back(label + ": only in B");
  }
  return Status::Ok();
}

// Every tensor of a non-pipeline checkpoint's `module`, by dotted name.
void CollectTensors(const Value& v, const std::string& prefix, std::map<std::string, const Tensor*>* out) {
  if (v.is(Value::Kind::kTensor)) {
    (*out)[prefix] = &v.as_tensor();
    return;
  }
  const Items* items = DictItems(v);
  if (items == nullptr) return;
  for (const auto& [k, child] : *items) {
    if (k.is(Value::Kind::kString)) CollectTensors(child, prefix.empty() ? k.as_string() : prefix + "." + k.as_string(), out);
  }
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.storage->dtype == b.storage->dtype && a.sizes == b.sizes &&
         std::memcmp(TensorData(a), TensorData(b), static_cast<size_t>(a.numel()) * ElementSize(a.storage->dtype)) == 0;
}

// Non-pipeline checkpoints keep their TP layout: modules compare rank by rank.
void CompareModules(const LogicalCheckpoint& a, const LogicalCheckpoint& b, VerifyReport* report) {
  if (a.tp != b.tp) {
    report->differences.push_back("TP " + std::to_string(a.tp) + " vs " + std::to_string(b.tp));
    return;
  }
  for (int t = 0; t < a.tp; ++t) {
    std::map<std::string, const Tensor*> ta, tb;
    CollectTensors(*Find(a.metadata[t], "module"), "", &ta);
    CollectTensors(*Find(b.metadata[t], "module"), "", &tb);
    for (const auto& [name, tensor] : ta) {
      auto other = tb.find(name);
      ++report->tensors_compared;
      report->elements_compared += tensor->numel();
      if (other == tb.end() || !SameBytes(*tensor, *other->second)) {
        report->differences.push_back(ModelStatesName(t) + " module." + name + ": differs or only in A");
      }
    }
    for (const auto& [name, tensor] : tb) {
      if (!ta.count(name)) report->differences.push_back(ModelStatesName(t) + " module." + name + ": only in B");
    }
  }
}

// The state of `name` on TP rank `t`, compared as is (no TP change possible).
Status CompareLocalStates(const SourceOptimizer& opt_a, const SourceOptimizer& opt_b, int tp,
                          const std::string& name, const std::string& state, VerifyReport* report) {
  for (int t = 0; t < tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<uint8_t> da, opt_a.Gather(name, t, state));
    RESHARD_ASSIGN_OR_RETURN(std::vector<uint8_t> db, opt_b.Gather(name, t, state));
    ++report->tensors_compared;
    report->elements_compared += static_cast<int64_t>(da.size() / 4);
    if (da != db) report->differences.push_back("optimizer " + state + " " + name + ": differs");
  }
  return Status::Ok();
}

// The optimizer state verify compares; null when there is none to compare
// (without pipelining the FP16_Optimizer state is carried whole).
Result<std::unique_ptr<SourceOptimizer>> ComparableOptimizer(const LogicalCheckpoint& c,
                                                             const VerifyOptions& options) {
  if (!HasOptimizerState(c) || (!c.pipeline && c.files.optimizer_files.empty())) {
    return std::unique_ptr<SourceOptimizer>();
  }
  return SourceOptimizer::Load(c, options.allowed_classes);
}

// Every element of every optimizer state (fp32 masters, moments, ...), per parameter.
Status CompareOptimizers(const LogicalCheckpoint& a, const SourceOptimizer* opt_a,
                         const LogicalCheckpoint& b, const SourceOptimizer* opt_b,
                         const VerifyOptions& options, VerifyReport* report) {
  if (opt_a == nullptr || opt_b == nullptr) {
    if (opt_a != nullptr || opt_b != nullptr) {
      report->notes.push_back(std::string("optimizer state not compared: only ") +
                              (opt_a != nullptr ? "A" : "B") + " has optimizer shards");
    }
    return Status::Ok();
  }
  if (opt_a->states() != opt_b->states()) {
    report->differences.push_back("optimizer: A and B hold different per-element states");
    return Status::Ok();
  }
  const std::vector<std::string> names_b = opt_b->ParamNames();
  for (const std::string& name : opt_a->ParamNames()) {
    if (std::find(names_b.begin(), names_b.end(), name) == names_b.end()) {
      report->differences.push_back("optimizer " + name + ": only in A");
      continue;
    }
    for (const std::string& state : opt_a->states()) {
      if (!a.pipeline) {
        RESHARD_RETURN_IF_ERROR(CompareLocalStates(*opt_a, *opt_b, a.tp, name, state, report));
        continue;
      }
      RESHARD_ASSIGN_OR_RETURN(StateTensor sa, StateTensor::Gather(a, *opt_a, name, state));
      RESHARD_ASSIGN_OR_RETURN(StateTensor sb, StateTensor::Gather(b, *opt_b, name, state));
      RESHARD_RETURN_IF_ERROR(CompareWhole({a, sa.layer_index(), sa.tensor_index(), sa.tensor()},
                                           {b, sb.layer_index(), sb.tensor_index(), sb.tensor()},
                                           "optimizer " + state + " " + name, options.replicated,
                                           report));
    }
  }
  return Status::Ok();
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

// ZeRO-3 checkpoints: every element of every state of every parameter.
Result<VerifyReport> VerifyZero3(const CheckpointFiles& fa, const CheckpointFiles& fb,
                                 const VerifyOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(auto a, Zero3Checkpoint::Load(fa, options.allowed_classes));
  RESHARD_ASSIGN_OR_RETURN(auto b, Zero3Checkpoint::Load(fb, options.allowed_classes));
  VerifyReport report;
  report.notes.push_back("A: " + a->Summary());
  report.notes.push_back("B: " + b->Summary());
  if (a->mp() != b->mp() || a->states() != b->states()) {
    report.differences.push_back("model-parallel size or optimizer states differ");
    return report;
  }
  for (int mp = 0; mp < a->mp(); ++mp) {
    for (const auto& group : a->ranks()[mp].sub_groups) {
      for (const Zero3Param& p : group) {
        for (const std::string& state : a->states()) {
          RESHARD_ASSIGN_OR_RETURN(std::vector<float> va, a->Gather(mp, p.name, state));
          Result<std::vector<float>> vb = b->Gather(mp, p.name, state);
          ++report.tensors_compared;
          report.elements_compared += static_cast<int64_t>(va.size());
          if (!vb.ok() || std::memcmp(va.data(), vb->data(), va.size() * 4) != 0 || va.size() != vb->size()) {
            report.differences.push_back("optimizer " + state + " " + p.name + ": differs or only in A");
          }
        }
      }
    }
  }
  if (a->iteration() != b->iteration()) report.differences.push_back("iteration differs");
  return report;
}

Result<VerifyReport> Verify(const std::string& a_path, const std::string& b_path,
                            const VerifyOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles fa, ScanCheckpoint(a_path));
  RESHARD_ASSIGN_OR_RETURN(CheckpointFiles fb, ScanCheckpoint(b_path));
  if (fa.IsZero3() != fb.IsZero3()) {
    return Status::InvalidInput("only one of the checkpoints is a ZeRO-3 checkpoint; reshard "
                                "compares checkpoints of the same kind");
  }
  if (fa.IsZero3()) return VerifyZero3(fa, fb, options);
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> a, LoadForCommand(std::move(fa), options));
  CommonOptions b_options = options;
  if (!options.rules_b.empty()) b_options.rules = options.rules_b;
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<LogicalCheckpoint> b, LoadForCommand(std::move(fb), b_options));
  RESHARD_RETURN_IF_ERROR(a->FirstError().WithContext(a_path));
  RESHARD_RETURN_IF_ERROR(b->FirstError().WithContext(b_path));
  VerifyReport report;
  report.notes.push_back("A: " + LayoutSummary(*a));
  report.notes.push_back("B: " + LayoutSummary(*b));
  if (a->pipeline != b->pipeline) {
    return Status::InvalidInput("one checkpoint is a pipeline checkpoint and the other is not; "
                                "reshard compares checkpoints of the same kind");
  }
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceOptimizer> opt_a, ComparableOptimizer(*a, options));
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceOptimizer> opt_b, ComparableOptimizer(*b, options));
  if (a->pipeline) {
    // Averaged replicas come from the averaged masters where there are masters.
    const bool average = options.replicated == ReplicatedPolicy::kAverage;
    RESHARD_RETURN_IF_ERROR(CompareWeights(*a, average ? opt_a.get() : nullptr, *b,
                                           average ? opt_b.get() : nullptr, options.replicated,
                                           &report));
  } else {
    CompareModules(*a, *b, &report);
  }
  RESHARD_RETURN_IF_ERROR(CompareOptimizers(*a, opt_a.get(), *b, opt_b.get(), options, &report));
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
