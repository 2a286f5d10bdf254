// A model state dict and its optimizer's, as PyTorch saves them together in
// one Distributed Checkpoint (torch's `get_state_dict`, torchtitan's
// checkpointer, Accelerate's FSDP saves), read as the pipeline model of the
// family whose rules have a `torchtitan` section, at TP 1, PP 1, with its
// Adam/AdamW state: what the torchtitan, DCP-recipe and Accelerate formats
// share (formats/torchtitan/, formats/dcp_recipe/, formats/accelerate/), each
// naming its prefixes and key names in a StateDictKeys.
//
// The model's keys are either the section's (torchtitan's module:
// `tok_embeddings.weight`, q and k rows of each head in interleaved rotary
// pairs, which the section renames and reorders as runs of the chunks' bytes)
// or the family's HF module's (the section's `hf` names, as an HF
// transformers model's state dict has them). The HF import (hf_import.h)
// joins the HF tensors into the canonical ones. No such save records the
// model config: the section's `config` derives the sizes from the tensors'
// shapes or gives torchtitan's defaults (a note lists those); the head count
// comes from --set, or from a config file beside `.metadata` (what reshard
// recorded for torchtitan; an Accelerate checkpoint's config.json).
//
// The optimizer state is torch's flat, FQN-keyed Adam/AdamW state dict under
// a prefix Q: `Q.state.<fqn>.{exp_avg, exp_avg_sq, step}`, and its param
// groups either flat (`Q.param_groups.<fqn>.<hyperparameter>`, torch's
// flatten_optimizer_state_dict) or as torch keeps them
// (`Q.param_groups.<i>.<hyperparameter>`, `Q.param_groups.<i>.params`: the
// group's FQNs). The moments are renamed and joined as their weights are;
// the fp32 master is the parameter itself (such runs train fp32 parameters).
// Anything else in the folder is not carried; a note names it.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "logical/imported_layers.h"
#include "logical/imported_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"
#include "util/box.h"

namespace reshard {

// A DCP checkpoint's content as the format registry hands it over.
struct DcpTensors {
  std::string folder;
  std::vector<std::string> files;
  std::map<std::string, ImportedTensor> tensors;  // every tensor whole, by key (runs of its chunks)
  std::vector<std::string> objects;               // the keys of the plain objects
  std::function<Result<Value>(const std::string& key)> read_object;
  // Where the mesh is read from: each tensor's chunks, by key, and the ranks
  // that wrote (0: not known).
  std::map<std::string, std::vector<Box>> chunks;
  int writing_ranks = 0;
};

// Where a format keeps the model and its optimizer in the folder, and how it
// names the model's keys.
struct StateDictKeys {
  std::string format;  // "torchtitan": notes, ImportedOptimizer::layout
  std::string label;   // "torchtitan checkpoint": what messages call the folder
  // The model's keys: those under `model_prefix` ("model.", "app.model."); with
  // an empty one, every top-level key but `run_states`, optionally nested
  // under `nested_prefix` (torchtitan before mid-2025 saved `model.` keys).
  std::string model_prefix;
  std::vector<std::string> run_states;
  std::string nested_prefix;
  std::string optim_prefix;  // "optimizer.", "optim.": Q above, with its dot
  // The model's keys are its HF module's (the section's `hf` names) rather
  // than the section's `keys`.
  bool hf_keys = false;
  // A file beside `.metadata` holding config.json fields that win ("": none).
  std::string recorded_config;
  // The step the save records in a file of its own (an HF Trainer's
  // trainer_state.json), named for the facts; none: the folder's name step-N.
  std::optional<int64_t> iteration;
  std::string iteration_from;
};

struct StateDictImport {
  LogicalCheckpoint logical;
  std::vector<std::string> files;
  std::string what;                // "torchtitan checkpoint (rule set megatron-llama, ...)"
  std::vector<std::string> notes;  // what the import chose or left out
  std::optional<ImportedOptimizer> optimizer;
  Status optimizer_status;  // why the optimizer state is not read (ok when there is none)
  RecordedFacts facts;      // its step, mesh and model config, for inspect
  // The mesh it was saved at, where its chunks show it for certain (0: not
  // shown): TP; and the data-parallel shards (dp_shard) with PP 1 when they
  // and TP account for every rank that wrote.
  int tp = 0, pp = 0, dp = 0;
};

// Whether some model key of `dcp` is a model key of a `torchtitan` section
// of the rule sets `rules_spec` names (all built-in ones when empty); with
// the section's keys, one that is not also its HF name, so that an HF
// module's state dict (lm_head.weight) is not taken for torchtitan's.
bool HoldsSectionModelKey(const DcpTensors& dcp, const StateDictKeys& keys, const std::string& rules_spec);

// Reads `dcp` as the model of the first family that fits it. Errors (one
// line): a model key no section maps (each candidate's reason), a size the
// tensors do not give and --set does not (naming the --set), the --rules
// set's reason. The optimizer state's problems (another optimizer than
// Adam's, an incomplete state) are StateDictImport::optimizer_status.
Result<StateDictImport> ReadStateDictImport(const DcpTensors& dcp, const StateDictKeys& keys,
                                            const CommonOptions& options);

}  // namespace reshard
