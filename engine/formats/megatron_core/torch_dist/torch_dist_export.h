// `export --to torch_dist`: Megatron-Core's `torch_dist` checkpoint (a
// PyTorch Distributed Checkpoint, container/dcp_writer.h) at a chosen TP
// and PP, from a source whose rule set has a `torch_dist` section
// (rules/rule_set.h, TorchDistLayout), as Megatron-LM lays it out (a virtual
// pipeline, --vpp, is in the args and the dp_reshardable buckets only: the
// keys are global):
//
//   OUT/latest_checkpointed_iteration.txt       the iteration
//   OUT/iter_{N:07d}/metadata.json              {"sharded_backend": "torch_dist", ...}
//   OUT/iter_{N:07d}/.metadata                  the index of every item
//   OUT/iter_{N:07d}/__{rank}_0.distcp          rank = PP rank x TP + TP rank
//
// Every canonical tensor is written under the section's key (the first
// alternative, what current Megatron-Core names it); a block's tensors are
// stacked on a leading layer axis. Each TP rank writes its own pieces of
// each layer as chunks, boxes of the global tensor: the rank's rows of a
// column-parallel weight (two boxes for a tensor of `parts` sub-parameters,
// SwiGLU's [gate_r; up_r] in [all gate; all up]), its columns of a
// row-parallel one, its vocabulary rows; a replicated tensor is written
// once, by TP rank 0. Each tensor is written by DP rank 0, except the
// experts of a MoE model (stacked on an expert axis after the layer axis):
// at --ep N each (layer, expert) is a chunk of its own, written by the DP
// rank of its EP rank, as Megatron-Core's expert-DP replica 0 writes it.
// The rank tensors are the source's weights cut exactly as convert cuts
// DeepSpeed layer files (SourceCheckpoint::WeightsForTp), which are
// Megatron's own per-rank tensors. Beside them: the common state (args,
// iteration, checkpoint_version, the optimizer's param groups and
// learning-rate scheduler, formats/megatron_core/common/megatron_scheduler.h)
// and each linear layer's empty `_extra_state`.
//
// The form is a Megatron-Core version's, as each loads only its own
// optimizer layouts (--megatron-core-version; by default the layout's, else
// a torch_dist source's own, else 0.19):
//   0.19  the common state is the `common_state` item; the optimizer state
//         fully_reshardable (shaped like the model keys) or dp_reshardable
//         (flat buckets, dp_reshardable_items.h, cut at --ddp-bucket-size
//         on the first stage)
//   0.14  the common state is common.pt (metadata.json says
//         "common_backend": "torch"); the optimizer state
//         fully_sharded_model_space (formats/megatron_core/common/nd_reformulation.h), whose
//         original shapes `.metadata`'s mcore_data records
// A model with experts' optimizer state is written in 0.19's layouts for
// the optimizers Megatron-Core builds at the target's EP
// (formats/megatron_core/common/expert_optimizers.h): fully_reshardable its
// states' chunks where its weights' are, each optimizer's param groups in
// the common state; dp_reshardable at EP 1 one optimizer's buckets, the
// experts among the dense parameters, at EP > 1 a ChainedOptimizer's:
// `chained_0.` the dense parameters' over the DP ranks, `chained_1.` each
// EP rank's experts' over the expert-data-parallel ranks.
// No RNG state.
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/megatron_core/common/torch_dist_rules.h"

namespace reshard {

// `export --to torch_dist`: its options and its planner.
TargetFormat TorchDistTarget();

}  // namespace reshard
