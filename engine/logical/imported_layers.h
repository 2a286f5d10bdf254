// A model another format read (an HF folder, a Megatron-Core torch_dist
// checkpoint) laid out as a pipeline model of its rule set at TP 1, PP 1.
//
// The format reads its tensors into canonical tensors: each a placeholder
// tensor value (dtype and shape) and, where its elements are not one stored
// tensor as is, the byte runs that make it (a SourceShard). LayOutImported
// puts each into the layer file its rule set gives it, in the rule set's
// first numbering, and DescribeCheckpoint then describes them like any
// checkpoint's; AttachImportedRuns gives the described tensors their runs.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "logical/logical_checkpoint.h"

namespace reshard {

// What the format that read a model records of its checkpoint, in that
// format's own terms, as (name, value) lines ("form", "Megatron-Core 0.19"):
// what inspect prints of an imported model instead of any other format's
// metadata.
using RecordedFacts = std::vector<std::pair<std::string, std::string>>;

struct ImportedTensor {
  Value tensor;                      // its dtype and shape (and its bytes when `runs` is unset)
  std::optional<SourceShard> runs;   // the elements in order, when they are not `tensor`'s own
};

// Runs of layer files' tensors, by (layer id, key), for AttachImportedRuns.
using ImportedRuns = std::map<std::pair<int, std::string>, SourceShard>;

// The layers of `rules`' first numbering with `blocks` blocks, each holding
// the canonical tensors its rules name (an expert rule, literal but for its
// expert id, one per expert of `experts`; 0: a model without experts); messages name each by its canonical
// name and the stored tensors `source_of` says it is made of
// ("layers.0.self_attention.query_key_value.weight (from
// decoder.layers.self_attention.linear_qkv.weight)"), never by a layer file. Errors: a rule whose key pattern
// names no one key, a required tensor missing (`source_of(name)` says which
// stored tensors it would be made of, "" when none), a tensor no layer holds.
Result<std::vector<LogicalLayer>> LayOutImported(const RuleSet& rules, int64_t blocks, int64_t experts,
                                                 const std::map<std::string, ImportedTensor>& tensors,
                                                 const std::function<std::string(const std::string&)>& source_of,
                                                 const std::string& what, ImportedRuns* runs);

// The rule of canonical tensor `name` in LayOutImported's layers; an error
// naming `what` when none holds it.
Result<const ParamRule*> ImportedRuleOf(const RuleSet& rules, int64_t blocks, int64_t experts,
                                        const std::string& name, const std::string& what);

// Sets the args a layout change rewrites to the imported model's layout
// (TP 1, PP 1, DP 1), and the training dtype flags to the weights' dtype.
void SetImportedLayoutArgs(DType weights, Value* metadata);

// Adds the metadata keys `rules` detects its checkpoints by (Megatron's
// checkpoint_info / universal_checkpoint_info) where missing, and records the
// vocabulary: `padded` rows, and the true size where the rules read it when
// it is known.
void SetImportedVocab(const RuleSet& rules, int64_t padded, std::optional<int64_t> original, Value* metadata);

// Records the true vocabulary size where the rules read it (before
// DescribeCheckpoint, which reads it, when it is not known from the tensors).
void SetImportedVocabSize(const RuleSet& rules, int64_t size, Value* metadata);

// Gives the described tensors of `ckpt` (after DescribeCheckpoint) their runs.
void AttachImportedRuns(ImportedRuns runs, LogicalCheckpoint* ckpt);

}  // namespace reshard
