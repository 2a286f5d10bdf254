// LogicalCheckpoint: a source checkpoint seen as whole tensors with rules.
//
// Loading reads every mp_rank file and every layer file (pickles only; tensor
// data stays memory-mapped), picks the rule set and numbering, and describes
// each tensor of each layer file once: its rule, its full logical shape, and
// the per-TP-rank shards it is made of. Everything wrong with the checkpoint
// is collected as Findings rather than stopping at the first, so `lint` can
// report all of it; `convert` refuses when any finding is an error.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/deepspeed/checkpoint_files.h"
#include "pickle/value.h"
#include "reshard/reshard.h"
#include "rules/rule_set.h"

namespace reshard {

// One tensor key of one layer, across the source TP ranks.
struct LogicalTensor {
  std::string key;
  const ParamRule* rule = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> local_shape;  // identical on every source TP rank
  std::vector<int64_t> full_shape;   // the unsharded tensor (vocab: padded rows)
  int64_t blocks = 1;                // resolved rule->blocks (1 when unset)
  std::vector<const Tensor*> shards;  // index = source TP rank
};

// One file-owning pipeline spec (embedding, one block, final norm, head).
struct LogicalLayer {
  int id = 0;          // spec index = the NN of layer_NN files
  std::string role;    // spec role ("embedding", "block", ...)
  std::vector<Value> roots;  // parsed layer file per source TP rank
  std::vector<LogicalTensor> tensors;  // in file order
};

struct VocabInfo {
  int64_t padded_rows = 0;              // rows of the source vocab tensors
  std::optional<int64_t> original_size;  // true vocabulary size, when recorded
  std::optional<int64_t> divisible_by;
  std::optional<int64_t> pad_to;
};

struct LogicalCheckpoint {
  CheckpointFiles files;
  // False for a non-pipeline DeepSpeed checkpoint (HF Trainer, Accelerate,
  // Megatron-DeepSpeed --no-pipeline-parallel): the whole model sits in each
  // mp_rank file's `module`, there are no layer files and no rules, and only
  // the data-parallel size can change.
  bool pipeline = true;
  std::shared_ptr<const RuleSet> rules;  // null when !pipeline
  std::string numbering;           // which of the rule set's spec lists matched
  std::vector<SpecEntry> specs;    // that list, with `block` expanded
  int tp = 1, pp = 1, dp = 1;      // dp from the optimizer shards, else dp_world_size
  int64_t iteration = 0;
  std::vector<Value> metadata;     // mp_rank files, index = p * tp + t
  std::vector<LogicalLayer> layers;  // in id order
  VocabInfo vocab;
  std::vector<Finding> findings;

  bool HasErrors() const;
  // First error finding as a Status (ok when there is none).
  Status FirstError() const;
  const Value& args() const;  // metadata[0]["args"] (None when absent)
};

struct LoadOptions {
  std::string rules;  // path or built-in name; empty = detect
  std::set<std::string> allowed_classes;
};

// Reads and describes the checkpoint at `path`. A Status error means the input
// could not be understood at all (bad path, unreadable files, no rule set);
// problems with individual tensors are findings.
Result<std::unique_ptr<LogicalCheckpoint>> LoadLogicalCheckpoint(const std::string& path,
                                                                 const LoadOptions& options);
// The same for files already found with ScanCheckpoint.
Result<std::unique_ptr<LogicalCheckpoint>> LoadLogicalCheckpoint(CheckpointFiles files,
                                                                 const LoadOptions& options);

// First byte of a contiguous tensor's elements (inside its mapped storage).
const uint8_t* TensorData(const Tensor& t);

// "layer_05/self_attention.dense.bias"
std::string TensorLabel(int layer_id, const std::string& key);

}  // namespace reshard
