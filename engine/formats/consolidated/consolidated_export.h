// Consolidated weights: one state dict of whole tensors under their
// canonical names (what DeepSpeed's zero_to_fp32.py gives, without loading
// anything whole), from any source's FullTensors.
//
// By default each parameter comes from its fp32 master where the checkpoint
// has optimizer state, else from the weights; vocabulary padding rows are
// stripped; tied weights appear once (a source lists each tensor once).
// Files: model.safetensors, or model-0000K-of-0000N.safetensors with
// model.safetensors.index.json when the tensors exceed the shard size; the
// same as pytorch_model*.bin (torch.save) on request. Each file is one
// job that streams its tensors.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

struct ConsolidatedOptions {
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  bool from_weights = false;           // the weights even where there are masters
  std::optional<DType> dtype;          // floating tensors cast to it; unset = as stored
  int64_t max_shard_size = 0;          // bytes per file; a bigger tensor gets its own
  bool torch_format = false;           // pytorch_model*.bin instead of safetensors
  std::optional<int64_t> vocab_size;   // true vocabulary rows; unset = as the source records
};

// `export --to consolidated`: its options and its planner.
TargetFormat ConsolidatedTarget();

// Plans the files. `src` must outlive the plan and its jobs.
Result<OutputPlan> PlanConsolidated(const SourceCheckpoint& src,
                                                     const ConsolidatedOptions& options,
                                                     std::vector<std::string>* notes);

}  // namespace reshard
