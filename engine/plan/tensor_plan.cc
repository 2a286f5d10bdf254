#include "plan/tensor_plan.h"

#include <algorithm>
#include <cstdio>

#include "logical/tp_placement.h"
#include "plan/slicing.h"
#include "util/shape.h"


namespace reshard {

int64_t TensorPlan::numel() const { return ShapeNumel(shape); }

ReplicatedPolicy PolicyFor(const ParamRule& rule, ReplicatedPolicy command_line) {
  return rule.drift ? *rule.drift : command_line;
}

Status CheckVocabRepaddable(const LogicalCheckpoint& src, std::optional<int64_t> vocab_size) {
  const VocabInfo& vocab = src.vocab;
  if (vocab.padded_rows == 0 || vocab.pad_to) return Status::Ok();
  if (!vocab_size && !vocab.original_size) {
    return Status::InvalidInput("a TP change pads the vocabulary from its true size, which is " +
                                src.rules->vocab_original_size().HowToGive() +
                                " (or --vocab-size N, the tokenizer's size)");
  }
  if (!vocab.divisible_by) {
    return Status::InvalidInput("a TP change pads the vocabulary to a multiple of the divisor, which is " +
                                src.rules->vocab_divisible_by().HowToGive());
  }
  if (*vocab.divisible_by < 1) {  // given, but not a divisor
    const std::vector<std::string> paths = src.rules->vocab_divisible_by().Paths();
    const std::string name = paths.empty() ? "the divisor" : paths.front();
    return Status::InvalidInput("a TP change pads the vocabulary to a multiple of " + name + ", which is " +
                                std::to_string(*vocab.divisible_by) + " (from --set or the checkpoint's "
                                "metadata); it must be 1 or more: give the training run's value with --set " +
                                name.substr(name.rfind('.') + 1) + "=N");
  }
  return Status::Ok();
}

namespace {

// The TP the vocabulary's padding was made for: the checkpoint's own, or
// the save's an import was read from.
int PaddingTp(const LogicalCheckpoint& src) { return src.vocab.padded_for_tp > 0 ? src.vocab.padded_for_tp : src.tp; }

// Whether the vocabulary of `src` is padded again for TP `tp`: its padding
// was made for another TP, or stripped.
bool Repadded(const LogicalCheckpoint& src, int tp) {
  const VocabInfo& vocab = src.vocab;
  return vocab.padded_rows != 0 && (tp != PaddingTp(src) || vocab.padding_stripped);
}

// How to give the value at `ref`'s first path.
std::string SetFlag(const MetaRef& ref) {
  const std::vector<std::string> paths = ref.Paths();
  return paths.empty() ? "a number in the rule file" : "--set " + paths.front() + "=N";
}

void AddMissing(MissingValue value, std::vector<MissingValue>* missing) {
  for (const MissingValue& m : *missing) {
    if (m.give == value.give) return;
  }
  missing->push_back(std::move(value));
}

// The block counts (heads, KV heads) the rules of the checkpoint's layers read and cannot resolve.
void MissingBlockCounts(const LogicalCheckpoint& src, std::vector<MissingValue>* missing) {
  const RuleInputs inputs = src.inputs();
  for (const LogicalLayer& layer : src.layers) {
    const auto role = src.rules->layers().find(layer.role);
    if (role == src.rules->layers().end()) continue;
    for (const ParamRule& rule : role->second) {
      if (rule.blocks.empty()) continue;
      const std::optional<int64_t> n = rule.blocks.Resolve(inputs);
      if (n && *n > 0) continue;
      std::string key = rule.key_pattern;  // for people: without the regex's escapes
      key.erase(std::remove(key.begin(), key.end(), '\\'), key.end());
      AddMissing({rule.blocks.ToString() + " (the block count of " + layer.TensorLabel(key) + ")",
                  SetFlag(rule.blocks)},
                 missing);
    }
  }
}

}  // namespace

std::vector<MissingValue> MissingValues(const LogicalCheckpoint& src, std::optional<int> tp,
                                        std::optional<int64_t> vocab_size) {
  std::vector<MissingValue> missing;
  if (src.rules == nullptr) return missing;
  MissingBlockCounts(src, &missing);
  const VocabInfo& vocab = src.vocab;
  if (!tp || vocab.pad_to || !Repadded(src, *tp)) return missing;
  if (!vocab.divisible_by) {  // one given but below 1 is refused as invalid (CheckVocabRepaddable)
    AddMissing({src.rules->vocab_divisible_by().ToString() + " (the vocabulary padding's divisor)",
                SetFlag(src.rules->vocab_divisible_by())},
               &missing);
  }
  if (!vocab_size && !vocab.original_size) {
    AddMissing({"the true vocabulary size (" + src.rules->vocab_original_size().ToString() +
                    "; the padding is computed from it)",
                "--vocab-size N"},
               &missing);
  }
  return missing;
}

std::string MissingValuesMessage(const std::string& lead, const std::vector<MissingValue>& missing) {
  std::string what, give;
  for (size_t i = 0; i < missing.size(); ++i) {
    what += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i].what;
    give += (i == 0 ? "" : " ") + missing[i].give;
  }
  const bool one = missing.size() == 1;
  return lead + ": " + what + "; give " + (one ? "it" : "them") + " as the run was trained: " + give + " (or as " +
         (one ? "a fallback" : "fallbacks") + " in the rule file, [path, N])";
}

Status CheckValuesGiven(const LogicalCheckpoint& src, int tp, std::optional<int64_t> vocab_size) {
  return CheckNoneMissing(MissingValues(src, tp, vocab_size));
}

Status CheckNoneMissing(const std::vector<MissingValue>& all, const std::string& needer) {
  std::vector<MissingValue> missing;  // each value once, however many things need it
  for (const MissingValue& m : all) AddMissing(m, &missing);
  if (missing.empty()) return Status::Ok();
  return Status::InvalidInput(MissingValuesMessage(
      "the checkpoint does not record " + std::to_string(missing.size()) + (missing.size() == 1 ? " value " : " values ") +
          needer + " needs",
      missing));
}

void ReportMissingValues(const LogicalCheckpoint& src, const LintOptions& options, LintReport* report) {
  const bool target = options.target_tp > 0;
  const std::vector<MissingValue> missing =
      MissingValues(src, target ? options.target_tp : PaddingTp(src), options.vocab_size);
  if (!missing.empty()) {
    // The reading's one-value findings are replaced by the finding naming them all.
    auto& findings = report->findings;
    findings.erase(std::remove_if(findings.begin(), findings.end(),
                                  [](const Finding& f) { return f.message.rfind(kMissingBlockCount, 0) == 0; }),
                   findings.end());
    const std::string count = std::to_string(missing.size()) + (missing.size() == 1 ? " value" : " values");
    findings.push_back({Finding::Severity::kError,
                        MissingValuesMessage("the checkpoint does not record " + count + (target ? " a conversion to TP " +
                                             std::to_string(options.target_tp) + " needs" : " every conversion needs"),
                                             missing)});
  }
  if (target) return;
  const std::vector<MissingValue> tp_change = MissingValues(src, 0, options.vocab_size);
  if (tp_change.size() == missing.size()) return;
  report->findings.push_back(
      {Finding::Severity::kWarning,
       MissingValuesMessage("a TP change (convert --tp other than " + std::to_string(PaddingTp(src)) +
                                ") needs values the checkpoint does not record, which convert at TP " +
                                std::to_string(PaddingTp(src)) + " does without (lint --tp N checks a target)",
                            tp_change)});
}

Result<int64_t> TargetPaddedVocab(const LogicalCheckpoint& src, int tp,
                                  std::optional<int64_t> vocab_size) {
  const VocabInfo& vocab = src.vocab;
  // The TP the padding was made for keeps it, unless it was stripped.
  if (!Repadded(src, tp)) return vocab.padded_rows;
  if (vocab.pad_to) {
    if (*vocab.pad_to % tp != 0) {
      return Status::InvalidInput("args.pad_vocab_size_to = " + std::to_string(*vocab.pad_to) +
                                  " does not divide by the target TP " + std::to_string(tp));
    }
    return *vocab.pad_to;
  }
  RESHARD_RETURN_IF_ERROR(CheckVocabRepaddable(src, vocab_size));
  const int64_t true_size = vocab_size ? *vocab_size : *vocab.original_size;
  // The divisor is read from the checkpoint: a wrapped product would divide by zero.
  int64_t multiple, rounded_up;
  if (__builtin_mul_overflow(*vocab.divisible_by, int64_t{tp}, &multiple) ||
      __builtin_add_overflow(true_size, multiple - 1, &rounded_up)) {
    return Status::InvalidInput("padding the vocabulary of " + std::to_string(true_size) +
                                " rows to a multiple of " + std::to_string(*vocab.divisible_by) +
                                " times TP " + std::to_string(tp) +
                                " overflows 64 bits; the recorded divisor cannot be right");
  }
  return rounded_up / multiple * multiple;
}

std::string VocabPaddingNote(int64_t from, int64_t to, int tp, double pad_value) {
  if (from == to) return "";
  std::string note = "vocabulary: " + std::to_string(from) + " padded rows -> " + std::to_string(to) +
                     " for TP " + std::to_string(tp);
  if (to < from) return note + "; padding rows " + std::to_string(to) + "-" + std::to_string(from - 1) + " dropped";
  char value[32];
  std::snprintf(value, sizeof(value), "%g", pad_value);
  return note + "; new padding rows " + std::to_string(from) + "-" + std::to_string(to - 1) + " filled with " + value;
}

std::vector<int64_t> TargetShardShape(const LogicalTensor& t, int tp, int64_t padded_vocab) {
  std::vector<int64_t> shape = t.full_shape;
  switch (t.rule->policy) {
    case ParamRule::Policy::kReplicated: break;
    case ParamRule::Policy::kVocab: shape[0] = padded_vocab / tp; break;
    case ParamRule::Policy::kSplit: shape[t.rule->dim] /= tp; break;
  }
  return shape;
}

Status CheckSplittable(const LogicalTensor& t, int tp) {
  if (t.rule->policy != ParamRule::Policy::kSplit) return Status::Ok();
  const int64_t full = t.full_shape[t.rule->dim];
  const bool even = full % (static_cast<int64_t>(t.rule->parts) * tp) == 0;
  const bool whole_blocks = t.rule->blocks.empty() || t.blocks % tp == 0;
  if (even && whole_blocks) return Status::Ok();
  // The blocks first: a row count that does not divide follows from them,
  // and they are what the user chose (heads, KV heads).
  const std::string why = !whole_blocks ? BlocksPhrase(t) : std::to_string(full / t.rule->parts) + " rows per part";
  const bool one = !whole_blocks ? t.blocks == 1 : full / t.rule->parts == 1;
  return Status::InvalidInput("cannot split " + t.label + " over " + std::to_string(tp) + " TP ranks: its " + why +
                              (one ? " does" : " do") + " not divide by " + std::to_string(tp));
}

TensorPlan PlanTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index, int rank,
                      const TensorTarget& target) {
  const LogicalTensor& t = src.layers[layer_index].tensors[tensor_index];
  TensorPlan plan;
  plan.layer_index = layer_index;
  plan.tensor_index = tensor_index;
  plan.shape = TargetShardShape(t, target.tp, target.padded_vocab);
  const ParamRule& rule = *t.rule;
  if (rule.policy == ParamRule::Policy::kReplicated) {
    if (PolicyFor(rule, target.replicated) == ReplicatedPolicy::kAverage && t.shards.size() > 1 &&
        IsFloatingPoint(t.dtype)) {
      plan.average = true;
    } else {
      plan.copies.push_back({0, t.local_shape, std::vector<int64_t>(plan.shape.size(), 0), Box::Whole(plan.shape)});
    }
    return plan;
  }
  const bool vocab = rule.policy == ParamRule::Policy::kVocab;
  std::vector<int64_t> target_full = t.full_shape;
  if (vocab) target_full[0] = target.padded_vocab;
  const std::vector<Placement> placements = PlaceTpRank(rule, target_full, target.tp, rank).placements;
  const Box available = Box::Whole(t.full_shape);
  plan.cut_axis = vocab ? 0 : rule.dim;
  plan.copies = IntersectPlacements(placements, t.shards, available);
  if (vocab) plan.fills = FillsOutside(placements, available, target.vocab_pad_value);
  return plan;
}

TensorPlan PlanFullTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index,
                          ReplicatedPolicy replicated) {
  TensorTarget whole;
  whole.tp = 1;
  whole.padded_vocab = src.vocab.padded_rows;
  whole.replicated = replicated;
  return PlanTensor(src, layer_index, tensor_index, 0, whole);
}

TensorPlan WholeShardPlan(int shard, int64_t numel) {
  TensorPlan plan;
  plan.shape = {numel};
  plan.copies = {BoxCopy{shard, plan.shape, {0}, Box::Whole(plan.shape)}};
  return plan;
}

namespace {

// "[a,b)" of `axis` of a box at `offsets` with `sizes`; "[a,b)x[c,d)" of
// every axis for axis -1. A 0-d box is the one index [0,1).
std::string Interval(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes, int axis) {
  if (offsets.empty()) return "[0,1)";
  std::string s;
  for (size_t a = 0; a < offsets.size(); ++a) {
    if (axis >= 0 && static_cast<int>(a) != axis) continue;
    s += (s.empty() ? "[" : "x[") + std::to_string(offsets[a]) + "," +
         std::to_string(offsets[a] + sizes[a]) + ")";
  }
  return s;
}

}  // namespace

std::string DescribeSources(const TensorPlan& t) {
  if (t.average) return "mean of all TP replicas";
  std::string s;
  for (const BoxCopy& c : t.copies) {
    s += (s.empty() ? "" : ", ") + Interval(c.dst.offsets, c.dst.sizes, t.cut_axis) + " <- tp" +
         std::to_string(c.src_shard) + Interval(c.src_offsets, c.dst.sizes, t.cut_axis);
  }
  for (const BoxFill& f : t.fills) {
    s += ", " + Interval(f.dst.offsets, f.dst.sizes, t.cut_axis) + " = " + std::to_string(f.value);
  }
  return s;
}

}  // namespace reshard
