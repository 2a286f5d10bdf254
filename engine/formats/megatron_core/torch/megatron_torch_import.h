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
// cuts it), and from each stage's layers, numbered from 0 in every stage (in
// every model chunk of a virtual pipeline's `model0`, `model1`, ..., which
// take the layers in Megatron's interleaved order, megatron_layout.h's
// PipelineStages): runs of the files' bytes, nothing copied. Megatron-Core's keys are named by the
// rule set's `torch_dist` section, the legacy ones by its layer rules.
//
// Metadata: the args and iteration of the files, the sizes the section's
// shapes take from the tensors where the args do not record them.
// `_extra_state` entries and the last stage's replica of a tied embedding are
// dropped with a note.
//
// The distributed optimizer's state (--use-distributed-optimizer: a
// distrib_optim.pt beside each model_optim_rng.pt, distrib_optim.h) is read
// into the same canonical tensors: each rank's gathered buffers cut where the
// bucket layout of its parameters in the rule set's registration order puts
// them, each state of a tensor joined like its weight; the param groups and
// step from model_optim_rng.pt's `optimizer` entry. The optimizer state of a
// run without it (torch's own, in model_optim_rng.pt) is not read: a note
// says so.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "logical/imported_layers.h"
#include "logical/imported_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

struct MegatronTorchImport {
  LogicalCheckpoint logical;
  std::vector<std::string> files;  // every rank file
  std::string what;                // "Megatron-LM torch checkpoint (...): TP 2, PP 2; iteration 10 ..."
  std::vector<std::string> notes;  // what the import chose or left out
  // The distributed optimizer's state, when the checkpoint holds one reshard
  // reads; else why not, in optimizer_status (ok when it holds none).
  std::optional<ImportedOptimizer> optimizer;
  Status optimizer_status;
  RecordedFacts facts;  // its keys, saved layout, iteration and optimizer state, for inspect
  // The layout it was saved at: TP and PP as its rank folders show, DP as
  // its args record it (0: not recorded).
  int tp = 0, pp = 0, dp = 0;
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
