// LogicalCheckpoint: a source checkpoint seen as whole tensors with rules.
//
// A format reads its files (pickles only; tensor data stays memory-mapped)
// into layers of tensors with their per-rank shards; DescribeCheckpoint then
// picks the rule set and numbering and describes each tensor once: its rule,
// canonical name, full logical shape and the shards it is made of.
// Everything wrong with the checkpoint is collected as Findings rather than
// stopping at the first, so `lint` can report all of it; `convert` refuses
// when any finding is an error.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "logical/source_shard.h"
#include "pickle/value.h"
#include "reshard/reshard.h"
#include "rules/rule_set.h"

namespace reshard {

// One tensor key of one layer, across the source TP ranks.
struct LogicalTensor {
  std::string name;   // canonical, layout-independent ("layers.3.mlp.dense_4h_to_h.weight")
  std::string key;    // the key in its layer file
  std::string label;  // where it is, for messages ("layer_05/mlp.dense_4h_to_h.weight")
  const ParamRule* rule = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> local_shape;  // identical on every source TP rank
  std::vector<int64_t> full_shape;   // the unsharded tensor (vocab: padded rows)
  int64_t blocks = 1;                // resolved rule->blocks (1 when unset)
  std::string blocks_from;           // the rule->blocks alternative that gave it ("" when unset)
  std::vector<SourceShard> shards;   // the shard table: shard t is source TP rank t
};

// One file-owning pipeline spec (embedding, one block, final norm, head).
struct LogicalLayer {
  int id = 0;          // spec index (the NN of DeepSpeed's layer_NN files)
  std::string label;   // how its format names it ("layer_05")
  std::string role;    // spec role ("embedding", "block", ...)
  std::vector<Value> roots;  // the layer's state dict per source TP rank
  std::vector<LogicalTensor> tensors;  // in file order
  // How messages name the tensor of a key, where its format names it
  // otherwise than "<label>/<key>": a model another format read has no layer
  // files, so its tensors are named by canonical name and source key.
  std::map<std::string, std::string> key_labels;

  // How messages name the tensor of `key` ("layer_05/mlp.dense_4h_to_h.weight").
  std::string TensorLabel(const std::string& key) const {
    auto it = key_labels.find(key);
    return it != key_labels.end() ? it->second : label + "/" + key;
  }
};

struct VocabInfo {
  int64_t padded_rows = 0;              // rows of the source vocab tensors
  std::optional<int64_t> original_size;  // true vocabulary size, when recorded
  std::optional<int64_t> divisible_by;
  std::optional<int64_t> pad_to;
  // The vocabulary tensors hold the true rows only (a universal checkpoint):
  // args.padded_vocab_size describes the checkpoint they were taken from.
  bool padding_stripped = false;
  // The TP the padding was made for, where it is not the checkpoint's own
  // `tp` (0: it is): an import lays a save of TP 2 out at TP 1 with TP 2's
  // padding, which a TP 1 target must re-pad.
  int padded_for_tp = 0;
};

// "; vocabulary 112 padded rows (true size 100)" for a summary line; empty
// for a model without vocabulary tensors.
std::string VocabSummary(const VocabInfo& vocab);

struct LogicalCheckpoint {
  std::shared_ptr<const RuleSet> rules;  // null for a checkpoint without layers
  std::string numbering;           // which of the rule set's spec lists matched
  std::vector<SpecEntry> specs;    // that list, with `block` expanded
  int tp = 1, pp = 1, dp = 1;
  int64_t iteration = 0;
  std::vector<Value> metadata;     // per (pipeline, tensor) rank, index = p * tp + t
  Value settings = Value::MakeDict();  // --set values (logical/settings.h)
  std::vector<LogicalLayer> layers;  // in id order
  VocabInfo vocab;
  // Set when the source stores no weights of its own (a universal
  // checkpoint): the tensors' shards are the fp32 masters, and each weight is
  // its master cast to this dtype, as DeepSpeed makes them when it loads one.
  std::optional<DType> weights_from_masters;
  std::vector<Finding> findings;

  bool HasErrors() const;
  // First error finding as a Status (ok when there is none).
  Status FirstError() const;
  const Value& args() const;  // metadata[0]["args"] (None when absent)
  // The dtype `t` is written in as a weight.
  DType WeightDType(const LogicalTensor& t) const {
    return weights_from_masters && IsFloatingPoint(t.dtype) ? *weights_from_masters : t.dtype;
  }
  // What rules read values from: metadata[0], then the settings.
  RuleInputs inputs() const;
  void AddError(std::string message);
};

// Chooses the rule set (`rules`: a path or built-in name; empty = detect) for
// the layers a format has read (ids, labels and roots set), and describes
// every tensor: rule, canonical name, shapes, shards, vocabulary. `set` are
// the --set values (logical/settings.h). A Status error means no rule set
// applies or a setting is refused; problems with tensors become findings.
Status DescribeCheckpoint(const std::string& rules, const std::map<std::string, std::string>& set,
                          LogicalCheckpoint* ckpt);

// How the finding of a block count the checkpoint does not record begins
// (lint replaces it by one naming every missing value, plan/tensor_plan.h).
inline constexpr char kMissingBlockCount[] = "the rules' block count ";

// The tensor's indivisible blocks for messages, named by what gives their
// count: "2 KV heads (args.num_key_value_heads)", "1 head
// (args.num_attention_heads)", "3 blocks (12)".
std::string BlocksPhrase(const LogicalTensor& t);

// An integer field of a dict-like metadata value, or `fallback`.
int64_t MetadataInt(const Value& root, const char* key, int64_t fallback);

}  // namespace reshard
