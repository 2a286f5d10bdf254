// `export --to megatron`: NVIDIA Megatron-LM's `torch` checkpoint at a chosen
// TP and PP, from a source whose rule set describes its tensors'
// tensor-parallel layout (megatron-deepspeed-format.md §13).
//
//   OUT/latest_checkpointed_iteration.txt                  the iteration
//   OUT/iter_{N:07d}/mp_rank_{t:02d}[_{p:03d}]/model_optim_rng.pt
//
// Each file is what Megatron-LM's save_checkpoint writes for its rank: `args`
// (megatron_args.h), checkpoint_version 3.0, `iteration` and `model`
// (megatron_layout.h) — with --vpp V, `model0` ... `model{V-1}`, each model
// chunk's layers numbered from 0, interleaved (PipelineStages) — the keys of
// a model chosen by --layer-spec:
//   local, te   Megatron-Core's GPTModel (Megatron-LM >= 0.18 has no other)
//               with its local or Transformer Engine layer spec: one key per
//               tensor, named by the rule set's torch_dist section, with the
//               stage's own layer index; each module's `_extra_state` as its
//               state_dict() holds it without FP8 (None for Megatron-Core's
//               linear layers, an empty uint8 tensor for TE's modules)
//   legacy      the legacy GPTModel (--use-legacy-models, Megatron-LM <= 0.17)
// The rank tensors are the source's
// weights cut exactly as convert cuts DeepSpeed layer files
// (SourceCheckpoint::WeightsForTp), whose per-rank tensors are Megatron's own.
// The source's Adam state, where it has one, goes into distrib_optim.pt
// beside each file (distrib_optim.h); no RNG state is written.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// `export --to megatron`: its options and its planner.
TargetFormat MegatronTarget();

}  // namespace reshard
