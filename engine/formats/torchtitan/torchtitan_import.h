// A torchtitan checkpoint (a PyTorch Distributed Checkpoint as torchtitan's
// checkpointer saves it, `step-N/`) read as the pipeline model of the
// family whose rules have a `torchtitan` section, at TP 1, PP 1, with its
// AdamW state: what convert writes at any Megatron-DeepSpeed layout, and
// what lint, inspect, verify and the exports read like any checkpoint.
//
// torchtitan's model is the family's HF model under other keys
// (`tok_embeddings.weight` for `model.embed_tokens.weight`), its q and k
// projections' rows of each head in interleaved rotary pairs: the section
// renames each key and reorders those rows (runs of the chunks' bytes,
// nothing copied), and the HF import (hf_import.h) joins the HF tensors
// into the canonical ones. torchtitan records no model config: a folder
// reshard exported holds it in reshard-model.json (kTorchtitanModelFile),
// whose fields win; the section's `config` derives the others from the
// tensors' shapes, or gives torchtitan's defaults (a note that every command
// prints lists those); the head count comes from --set.
//
// The optimizer state is torchtitan's flat, FQN-keyed AdamW state dict under
// `optimizer.`: `state.<key>.{exp_avg, exp_avg_sq, step}` and
// `param_groups.<key>.<hyperparameter>`. The moments are renamed and joined
// as their weights are; the fp32 master is the parameter itself (torchtitan
// trains fp32 parameters). The other entries (train_state, lr_scheduler,
// dataloader) are not carried; a note names them.
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

namespace reshard {

// The keys of torchtitan's flat optimizer state dict: `<state prefix><key>.<state>`
// and `<groups prefix><key>.<hyperparameter>`.
inline constexpr char kTorchtitanStatePrefix[] = "optimizer.state.";
inline constexpr char kTorchtitanGroupsPrefix[] = "optimizer.param_groups.";
// The model config export --to torchtitan records beside `.metadata`, as
// HF config.json fields: what torchtitan keeps outside its checkpoint (in
// its run's model args), read back by this import.
inline constexpr char kTorchtitanModelFile[] = "reshard-model.json";

// A DCP checkpoint's content as the format registry hands it over.
struct DcpTensors {
  std::string folder;
  std::vector<std::string> files;
  std::map<std::string, ImportedTensor> tensors;  // every tensor whole, by key (runs of its chunks)
  std::vector<std::string> objects;               // the keys of the plain objects
  std::function<Result<Value>(const std::string& key)> read_object;
  // Where the mesh is read from: each tensor's chunks (the first index of
  // each along every dimension), by key, and the ranks that wrote (0: not known).
  std::map<std::string, std::vector<std::vector<int64_t>>> chunk_offsets;
  int writing_ranks = 0;
};

struct TorchtitanImport {
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

// Whether some key of `dcp` is a model key of a torchtitan section (the
// registry's test before it reads the checkpoint as one).
bool LooksLikeTorchtitan(const DcpTensors& dcp, const std::string& rules_spec);

// Reads `dcp` as the model of the first family that fits it. Errors (one
// line): a model key no section maps (each candidate's reason), a size the
// tensors do not give and --set does not (naming the --set), the --rules
// set's reason.
Result<TorchtitanImport> ReadTorchtitanImport(const DcpTensors& dcp, const CommonOptions& options);

}  // namespace reshard
