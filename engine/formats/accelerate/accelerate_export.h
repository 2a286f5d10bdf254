// `export --to accelerate`: a model and its AdamW state saved as Hugging Face
// Accelerate's save_fsdp_model and save_fsdp_optimizer save an FSDP run with
// SHARDED_STATE_DICT over `--dp-shard N` ranks (what the Trainer writes in
// each checkpoint-N/), which Accelerate's load_fsdp_model and
// load_fsdp_optimizer load back at N ranks:
//
//   OUT/pytorch_model_fsdp_0/   DCP: model.<fqn>, the family's HF module's names
//   OUT/optimizer_0/            DCP: optimizer.state.<fqn>.{exp_avg, exp_avg_sq, step},
//                               optimizer.param_groups.<i>.* (FSDP's optim_state_dict);
//                               with --fsdp-version 2 optimizer.state.<i>.*, the
//                               optimizer's own state_dict() as Accelerate's FSDP2
//                               saves it, in an FSDP2 source's order and groups
//   OUT/config.json             the model's config, as far as the source records it
//   OUT/trainer_state.json, scheduler.pt, ...   the source's run state
//
// The keys and the AdamW state dict are formats/fsdp2_dcp.h's
// (Fsdp2StateDictWriter), every tensor Shard(0) over the ranks; with the
// optimizer state the parameters are the source's fp32 masters. The Trainer's
// run state (trainer_state.json, scheduler.pt, rng_state_<rank>.pth) is an
// Accelerate source's, copied (the ranks' RNG states only at the save's world
// size); without one, trainer_state.json holds the source's step.
#pragma once

#include "formats/format.h"

namespace reshard {

// `export --to accelerate`: its options and its planner.
TargetFormat AccelerateTarget();

}  // namespace reshard
