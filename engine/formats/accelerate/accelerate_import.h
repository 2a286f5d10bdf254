// A Hugging Face Trainer / Accelerate FSDP checkpoint saved with
// SHARDED_STATE_DICT, as Accelerate's save_fsdp_model and save_fsdp_optimizer
// write it (the Trainer calls them for each checkpoint-N/):
//
//   checkpoint-N/pytorch_model_fsdp_0/   DCP: {"model": the HF module's state dict}
//   checkpoint-N/optimizer_0/            DCP: {"optimizer": FSDP.optim_state_dict}
//   checkpoint-N/trainer_state.json      its global_step is the iteration
//   checkpoint-N/scheduler.pt, rng_state_<rank>.pth, ...   the run's, not carried
//   checkpoint-N/config.json             where one was saved: the model's config
//
// The two DCP folders are read as one state dict (the registry joins them):
// the model's keys `model.<fqn>` are its HF module's names, the optimizer's
// `optimizer.state.<fqn>.{exp_avg, exp_avg_sq, step}` and
// `optimizer.param_groups.<i>.*`, which FSDP1 writes with the parameters'
// FQNs whether use_orig_params was set or not; hf_common/state_dict_import.h
// reads them as the pipeline model of the family whose rules name them, with
// its AdamW state.
//
// The FULL_STATE_DICT form (checkpoint-N/pytorch_model_fsdp.bin and
// optimizer.bin, torch.save files of the model's whole state dict and of
// FSDP1's full optim_state_dict, read with reshard's own pickle reader and
// never executed) is read as the same state dict, every tensor whole.
//
// Accelerate's FSDP2 saves (fsdp_version 2) write the optimizer's own
// state_dict(), keyed by parameter index: `optimizer.state.<i>.*`, and
// `optimizer.param_groups.<g>.params` the group's indices, which torch
// numbers in the order of the groups' parameters. The index of each
// parameter is read from the save itself: the groups' `param_names` where
// torch recorded them (an optimizer built from named_parameters()); else the
// order of the model's state dict, which is its named_parameters() order for
// an optimizer built over the module's parameters in that order, each group
// listing its own in that order (model.parameters(), the Trainer's groups),
// the groups' split told apart by the states' shapes. Where that does not
// establish one mapping (a tied copy, a buffer or a frozen parameter in the
// model's state dict, shapes that fit no split or several) the optimizer
// state is refused in one line naming what is missing.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "formats/hf_common/state_dict_import.h"
#include "reshard/reshard.h"

namespace reshard {

// The folders Accelerate names after the first model and optimizer.
inline constexpr char kAccelerateModelFolder[] = "pytorch_model_fsdp_0";
inline constexpr char kAccelerateOptimizerFolder[] = "optimizer_0";
// The Trainer's record of the run: its global_step is the checkpoint's step.
inline constexpr char kTrainerStateFile[] = "trainer_state.json";

// The export --to accelerate option naming the form (fsdp_version) of the
// optimizer's state dict: "1" FSDP1's optim_state_dict, keyed by FQN; "2"
// the optimizer's own state_dict(), keyed by parameter index.
inline constexpr char kFsdpVersionOption[] = "fsdp-version";

// An FSDP2 save's parameter indices: the model's FQN of each index, and each
// param group's indices, in the groups' order.
struct AccelerateParamIndex {
  std::vector<std::string> fqns;
  std::vector<std::vector<int64_t>> groups;
};

// The parameter indices of checkpoint-N `folder`'s optimizer state; nullopt
// when it is keyed by FQN (FSDP1) or there is none. Errors (one line): an
// index-keyed state whose mapping the save does not establish, naming what
// is missing.
Result<std::optional<AccelerateParamIndex>> ReadAccelerateParamIndex(const std::string& folder);

// The options of export --to accelerate that write the save's form again
// (its fsdp-version), read from `dcp` (ReadAccelerateImport's).
std::map<std::string, std::string> AccelerateSaveOptions(const DcpTensors& dcp);

// The checkpoint-N folder of an Accelerate FSDP save at `path`: `path` when
// it holds pytorch_model_fsdp_0/ or Accelerate's FULL_STATE_DICT
// pytorch_model_fsdp.bin, its parent when `path` is the model's or the
// optimizer's folder in it; "" for any other folder.
Result<std::string> AccelerateCheckpointFolder(const std::string& path);

// Whether checkpoint-N `folder` is the FULL_STATE_DICT form.
bool IsAccelerateFullStateDict(const std::string& folder);

// The FULL_STATE_DICT form in `folder` as a state dict: pytorch_model_fsdp.bin's
// items under `model.`, optimizer.bin's (where saved) under `optimizer.`,
// flattened as DCP flattens them. Errors (one line): a file that is not a
// torch.save of a dict; ReadTorchFile's (a pickled class it refuses).
Result<DcpTensors> ReadAccelerateFullStateDict(const std::string& folder);

// What the Trainer saved of the run in checkpoint-N `folder` beside the
// model's and optimizer's folders and config.json (trainer_state.json,
// scheduler.pt, rng_state_<rank>.pth, ...), by name, sorted.
std::vector<std::string> AccelerateRunFiles(const std::string& folder);

// Whether run file `name` is one rank's RNG state (rng_state_<rank>.pth, or
// rng_state.pth of a run on one process).
bool IsRankRngState(const std::string& name);

// Reads `dcp` (both DCP folders' items; its folder the checkpoint-N) as the
// model of the first family that fits it, with its AdamW state. Errors (one
// line): a trainer_state.json without its global_step; ReadStateDictImport's.
Result<StateDictImport> ReadAccelerateImport(const DcpTensors& dcp, const CommonOptions& options);

}  // namespace reshard
