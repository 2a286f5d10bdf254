// NVIDIA Megatron-LM's `torch` checkpoint (megatron_export.h's layout: one
// model_optim_rng.pt per tensor and pipeline rank) read as the pipeline model
// its family's rules describe, at TP 1, PP 1: what convert writes at any
// Megatron-DeepSpeed layout, and what lint, inspect, verify and the exports
// read like any checkpoint.
//
// The files hold Megatron-Core GPTModel's keys (local or Transformer Engine
// layer spec) or the legacy GPTModel's nested ones. Each canonical tensor is
// joined from its TP ranks' pieces, each placed where the rule set's TP cut
// of the tensor puts that rank's piece (logical/tp_placement.h, as the export
// cuts it), and from each stage's layers, numbered from 0 in every stage: runs
// of the files' bytes, nothing copied. Megatron-Core's keys are named by the
// rule set's `torch_dist` section, the legacy ones by its layer rules.
//
// Metadata: the args and iteration of the files, the sizes the section's
// shapes take from the tensors where the args do not record them. Weights
// only: an optimizer state in the files (or in distrib_optim.pt) is not read,
// and a note says so; `_extra_state` entries and the last stage's replica of
// a tied embedding are dropped with a note.
#pragma once

#include <string>
#include <vector>

#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

struct MegatronTorchImport {
  LogicalCheckpoint logical;
  std::vector<std::string> files;  // every rank file
  std::string what;                // "Megatron-LM torch checkpoint (...): TP 2, PP 2; iteration 10 ..."
  std::vector<std::string> notes;  // what the import chose or left out
};

// The iteration folder of the Megatron-LM `torch` checkpoint at `path`:
// `path` itself when it holds mp_rank_* folders with model_optim_rng.pt, or
// the iter_* folder a root's latest_checkpointed_iteration.txt names; "" when
// `path` is neither.
std::string MegatronTorchFolder(const std::string& path);

// Reads the checkpoint in `folder` (MegatronTorchFolder's) as the model of
// the first family that fits it. Errors (one line): a rank file missing or
// not parsing, TP ranks whose pieces of a key differ in shape or dtype, keys
// no rule set maps (each candidate's reason), the --rules set's reason.
Result<MegatronTorchImport> ReadMegatronTorchImport(const std::string& folder, const CommonOptions& options);

}  // namespace reshard
