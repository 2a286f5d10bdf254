// `export --to torchtitan`: a torchtitan checkpoint (a PyTorch Distributed
// Checkpoint as torchtitan's checkpointer saves one) of an FSDP2 run over
// `--dp-shard N` ranks, from a source whose rule set has a `torchtitan`
// section (rules/rule_set.h, TorchtitanLayout):
//
//   OUT/step-<iteration>/.metadata           the index of every item
//   OUT/step-<iteration>/__<rank>_0.distcp   rank 0 .. N-1, as FileSystemWriter names them
//
// The model is the HF export's tensors (hf_tensors.h, MapHfTensors) under
// the section's keys (the first of each entry), the q/k rows of each head
// re-interleaved into torchtitan's rotary pairs; a tied head is written
// under its own key too, as torch saves it. Each tensor is FSDP2's
// `Shard(0)` of it: rank r holds rows [r c, (r + 1) c), c = ceil(rows / N),
// the last ranks fewer or none (torch.chunk, which DTensor's Shard uses); a
// rank with no rows writes no chunk.
//
// torchtitan trains fp32 parameters, which are AdamW's masters: with the
// source's optimizer state (unless --weights-only) the parameters are its
// fp32 masters, and beside them, keyed by each parameter's key, what
// torch 2.6's flattened optimizer state dict holds: `exp_avg` and
// `exp_avg_sq` chunked like the parameter, `step` (an fp32 0-d tensor), and
// `param_groups.<key>.<hyperparameter>` bytes items of AdamW's fields.
// No train_state, lr_scheduler or dataloader items: torchtitan then starts
// those afresh (a note says so).
#pragma once

#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// Plans the folder. `src` must outlive the plan and its jobs.
Result<OutputPlan> PlanTorchtitan(const SourceCheckpoint& src, const ExportOptions& options,
                                  std::vector<std::string>* notes);

}  // namespace reshard
