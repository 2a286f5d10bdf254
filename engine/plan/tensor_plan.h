// TensorPlan: how one target tensor is made from a logical tensor's shards,
// as plain data.
//
// A target shard is filled by boxes copied from source shards (BoxCopy,
// naming the shard by its index in the logical tensor's shard table), by new
// padding (BoxFill), or is the element-wise mean of all replicas. Boxes are
// N-dimensional, so a tensor cut on several axes at once (an FSDP shard of a
// TP slice, a stacked layer axis) is planned like one cut on a single axis.
// Making a plan reads no tensor data; materialize.h executes one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"
#include "util/box.h"

namespace reshard {

// Copies the box of source shard `src_shard` (whose local tensor has
// `src_shape`) that starts at `src_offsets` to the box `dst` of the target.
struct BoxCopy {
  int src_shard = 0;
  std::vector<int64_t> src_shape;
  std::vector<int64_t> src_offsets;
  Box dst;
};

// Sets every element of the box `dst` of the target to `value`.
struct BoxFill {
  Box dst;
  double value = 0;
};

struct TensorPlan {
  int layer_index = 0;   // the source tensor: LogicalCheckpoint::layers[layer_index]
  int tensor_index = 0;  //   .tensors[tensor_index]
  std::vector<int64_t> shape;  // the target shard's shape
  bool average = false;  // element-wise mean of all source replicas (no copies)
  std::vector<BoxCopy> copies;  // in the order of their first target element
  std::vector<BoxFill> fills;
  // The axis the tensor is cut along, the one DescribeSources prints; -1 for
  // boxes cut on several axes, all of which it prints.
  int cut_axis = 0;
  int64_t numel() const;
};

// The target layout tensors are planned for.
struct TensorTarget {
  int tp = 1;
  int64_t padded_vocab = 0;  // rows of vocabulary tensors in all
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  double vocab_pad_value = 0;  // new vocabulary padding rows
};

// The effective drift policy of a replicated tensor.
ReplicatedPolicy PolicyFor(const ParamRule& rule, ReplicatedPolicy command_line);

// A value a conversion needs that neither the checkpoint, the rule file nor
// --set gives (a DeepSpeed-only save records no Megatron args).
struct MissingValue {
  std::string what;  // "args.num_attention_heads (the block count of layer_02/...)"
  std::string give;  // "--set args.num_attention_heads=N", "--vocab-size N"
};

// Those a conversion to TP `tp` needs (0: any TP but the source's; none:
// the vocabulary's padding is not made anew): every block count the rules
// read, at any TP, and the vocabulary's true size and divisor where its
// padding is computed anew for `tp`.
std::vector<MissingValue> MissingValues(const LogicalCheckpoint& src, std::optional<int> tp,
                                        std::optional<int64_t> vocab_size);

// "`lead`: a, b and c; give the values the run was trained with: --set ...
// --vocab-size N (or as fallbacks in the rule file)".
std::string MissingValuesMessage(const std::string& lead, const std::vector<MissingValue>& missing);

// One refusal naming every value of `missing` that `needer` ("this
// conversion") needs (ok when it is empty), so that a user needs one more
// try, not one per value.
Status CheckNoneMissing(const std::vector<MissingValue>& missing, const std::string& needer = "this conversion");

// CheckNoneMissing of what a conversion to TP `tp` lacks.
Status CheckValuesGiven(const LogicalCheckpoint& src, int tp, std::optional<int64_t> vocab_size);

// What lint says of them: with a target TP (options.target_tp), an error
// naming every value that conversion lacks; without one, an error for what
// every conversion needs and a warning for what a TP change would add.
void ReportMissingValues(const LogicalCheckpoint& src, const LintOptions& options, LintReport* report);

// Whether the values a TP change needs to re-pad the vocabulary are known
// (`vocab_size` is --vocab-size); the error names the ways to give them.
Status CheckVocabRepaddable(const LogicalCheckpoint& src, std::optional<int64_t> vocab_size);

// Rows of the target vocabulary tensors: the true vocabulary padded to a
// multiple of make_vocab_size_divisible_by x TP, as Megatron computes it.
Result<int64_t> TargetPaddedVocab(const LogicalCheckpoint& src, int tp,
                                  std::optional<int64_t> vocab_size);

// What re-padding the vocabulary from `from` to `to` rows for TP `tp` does
// ("vocabulary: 112 padded rows -> 128 for TP 4; new padding rows 112-127
// filled with 0"); empty when the rows stay.
std::string VocabPaddingNote(int64_t from, int64_t to, int tp, double pad_value);

// Shape of TP rank shards of `t` at `tp` ranks; vocab tensors get
// `padded_vocab` rows in all.
std::vector<int64_t> TargetShardShape(const LogicalTensor& t, int tp, int64_t padded_vocab);

// Refuses a target TP the tensor's structure cannot take.
Status CheckSplittable(const LogicalTensor& t, int tp);

// Target TP rank `rank`'s shard of tensor (layer_index, tensor_index).
TensorPlan PlanTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index, int rank,
                      const TensorTarget& target);

// The whole logical tensor (TP 1, replicas merged by `replicated`, source
// padding kept), for comparing checkpoints of different layouts.
TensorPlan PlanFullTensor(const LogicalCheckpoint& src, int layer_index, int tensor_index,
                          ReplicatedPolicy replicated);

// A 1-D target of `numel` elements copied whole from shard `shard`.
TensorPlan WholeShardPlan(int shard, int64_t numel);

// "[0,8) <- tp1[0,8), [8,12) = 0.000000": the copies and fills along the
// cut axis (every axis, joined by "x", when cut_axis is -1).
std::string DescribeSources(const TensorPlan& t);

}  // namespace reshard
