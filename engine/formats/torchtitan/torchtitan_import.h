// A torchtitan checkpoint (a PyTorch Distributed Checkpoint as torchtitan's
// checkpointer saves it, `step-N/`) read as the pipeline model of the
// family whose rules have a `torchtitan` section, at TP 1, PP 1, with its
// AdamW state: what convert writes at any layout, and what lint, inspect,
// verify and the exports read like any checkpoint.
//
// torchtitan keeps the model at the top level under its own module's keys
// (`tok_embeddings.weight`; `model.` before mid-2025), which the section
// renames, and its flat AdamW state under `optimizer.`; beside them its run
// state (train_state, lr_scheduler, dataloader), which is not carried. The
// reading is hf_common/state_dict_import.h's, which the DCP recipe's import
// shares. A folder reshard exported records the model config in
// reshard-model.json (kTorchtitanModelFile), whose fields win.
#pragma once

#include "formats/hf_common/state_dict_import.h"

namespace reshard {

// The keys of torchtitan's flat optimizer state dict: `<state prefix><key>.<state>`
// and `<groups prefix><key>.<hyperparameter>`.
inline constexpr char kTorchtitanStatePrefix[] = "optimizer.state.";
inline constexpr char kTorchtitanGroupsPrefix[] = "optimizer.param_groups.";
// The model config export --to torchtitan records beside `.metadata`, as
// HF config.json fields: what torchtitan keeps outside its checkpoint (in
// its run's model args), read back by this import.
inline constexpr char kTorchtitanModelFile[] = "reshard-model.json";

// Whether some key of `dcp` is a model key of a torchtitan section (the
// registry's test before it reads the checkpoint as one).
bool LooksLikeTorchtitan(const DcpTensors& dcp, const std::string& rules_spec);

// Reads `dcp` as the model of the first family that fits it
// (ReadStateDictImport's errors).
Result<StateDictImport> ReadTorchtitanImport(const DcpTensors& dcp, const CommonOptions& options);

}  // namespace reshard
