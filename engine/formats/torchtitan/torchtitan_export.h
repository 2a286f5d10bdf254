// `export --to torchtitan`: a torchtitan checkpoint (a PyTorch Distributed
// Checkpoint as torchtitan's checkpointer saves one) of an FSDP2 run over
// `--dp-shard N` ranks, or of a 2-D FSDP x TP run over N x `--tp T` ranks,
// from a source whose rule set has a `torchtitan` section (rules/rule_set.h,
// TorchtitanLayout):
//
//   OUT/step-<iteration>/.metadata           the index of every item
//   OUT/step-<iteration>/__<rank>_0.distcp   rank 0 .. N T - 1, as FileSystemWriter names them
//   OUT/step-<iteration>/reshard-model.json  the model config as HF config.json fields (the
//                                            ones the source records), which torchtitan keeps
//                                            in its run's args and reshard reads back
//
// The model is the HF export's tensors (hf_tensors.h, MapHfTensors) under
// the section's keys (the first of each entry), the q/k rows of each head
// re-interleaved into torchtitan's rotary pairs; a tied head is written
// under its own key too, as torch saves it.
//
// The ranks are torchtitan's mesh [dp_shard N, tp T], TP the fastest: rank
// d T + t. A tensor the section gives `tp: {dim: D}` is Shard(D) on the TP
// mesh (torchtitan's TP plan: ColwiseParallel and embeddings 0,
// RowwiseParallel 1), TP rank t holding the t-th of T equal shares of dim D
// (--tp must divide it, and its `blocks`, the heads); any other is
// replicated on TP and written once, by the TP rank 0 of each share. FSDP2
// then shards the rows of each TP share again, Shard(0) over the N dp ranks
// (`_StridedShard(0)` when TP shards rows too): dp rank d holds rows
// [d c, (d + 1) c) of the share, c = ceil(rows / N), the last ranks fewer
// or none (torch.chunk, which DTensor's Shard uses); a rank with no rows
// writes no chunk. Without --tp, T = 1: plain FSDP2 Shard(0).
//
// torchtitan trains fp32 parameters, which are AdamW's masters: with the
// source's optimizer state (unless --weights-only) the parameters are its
// fp32 masters, and beside them, keyed by each parameter's key, what
// torch 2.6's flattened optimizer state dict holds: `exp_avg` and
// `exp_avg_sq` chunked like the parameter, `step` (an fp32 0-d tensor), and
// `param_groups.<key>.<hyperparameter>` bytes items of AdamW's fields and
// initial_lr (which torch's LR schedulers add, and so dcp.load in a
// torchtitan run expects; the source's lr when it has none).
// No train_state, lr_scheduler or dataloader items: torchtitan then starts
// those afresh (a note says so).
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/hf_common/torchtitan_rules.h"

namespace reshard {

// `export --to torchtitan`: its options and its planner.
TargetFormat TorchtitanTarget();

}  // namespace reshard
