// `export --to dcp_recipe`: a model and its AdamW state saved as PyTorch's
// Distributed Checkpoint recipe saves an FSDP2 run over `--dp-shard N`
// ranks: `dcp.save({MODEL: model_sd, OPTIM: optim_sd})` of torch 2.6's
// `get_state_dict(model, optimizer)`, which the recipe's own code loads back
// (`get_state_dict` of its model, `dcp.load`, `set_state_dict`):
//
//   OUT/.metadata                 the index of every item, with torch's planner paths
//   OUT/__<rank>_0.distcp         rank 0 .. N - 1, as FileSystemWriter names them
//
// The model is the HF export's tensors (hf_tensors.h, MapHfTensors) under
// their HF names, `MODEL.<fqn>`, as the state dict of the family's HF
// transformers module has them (a tied head also under its own name). With
// the source's optimizer state (unless --weights-only) the parameters are
// its fp32 masters, and the optimizer's state dict is torch's for AdamW:
// `OPTIM.state.<fqn>.{exp_avg, exp_avg_sq, step}`, and its param groups
// (AdamW's fields, and initial_lr where the source records one)
// either as get_state_dict gives them (`--param-groups indexed`:
// `OPTIM.param_groups.<i>.<field>`, `.params` the group's FQNs; the
// source's groups, those with the same hyperparameters made one) or
// flattened (`flat`, flatten_optimizer_state_dict=True:
// `OPTIM.param_groups.<fqn>.<field>`). Every tensor is FSDP2's Shard(0)
// over the ranks (formats/fsdp2_dcp.h). The prefixes (`--prefixes
// MODEL,OPTIM`, dotted ones nesting: `app.model` is the tutorial's AppState)
// and the form are the source's when it is a recipe save, else `model,optim`
// and `indexed`, torch's defaults.
#pragma once

#include <map>
#include <string>

#include "formats/format.h"

namespace reshard {

// The target's options a recipe save records: its prefixes and the form of
// its param groups (kIndexedGroups or kFlatGroups).
inline constexpr char kRecipePrefixesOption[] = "prefixes";
inline constexpr char kRecipeGroupsOption[] = "param-groups";
inline constexpr char kIndexedGroups[] = "indexed";
inline constexpr char kFlatGroups[] = "flat";

// `export --to dcp_recipe`: its options and its planner.
TargetFormat DcpRecipeTarget();

}  // namespace reshard
