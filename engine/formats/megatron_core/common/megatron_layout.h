// Where NVIDIA Megatron-LM's `torch` checkpoint format puts things
// (megatron-deepspeed-format.md §13, §5.1): the file of each (tensor,
// pipeline) rank, the blocks of each pipeline stage, and each weight's place
// in the `model` dict that GPTModel.state_dict_for_save_checkpoint writes —
// nested for the legacy GPTModel, one flat key per tensor for Megatron-Core's
// (the torch_dist section's key with the stage's own layer index), and which
// torch_dist key a rank tensor has.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/format.h"
#include "reshard/status.h"
#include "rules/rule_set.h"

namespace reshard {

// The root file naming the checkpoint's iteration.
inline constexpr char kLatestIterationFile[] = "latest_checkpointed_iteration.txt";

// "iter_0000010/mp_rank_01/model_optim_rng.pt" when pp == 1, else
// "iter_0000010/mp_rank_01_002/model_optim_rng.pt".
std::string MegatronFileName(int64_t iteration, int tp_rank, int pp_rank, int pp);

// The name of a rank's folder (MegatronFileName's middle part):
// "mp_rank_01" -> {1, 0, false}, "mp_rank_01_002" -> {1, 2, true}; nullopt
// for any other name.
struct RankFolder {
  int tp_rank = 0, pp_rank = 0;
  bool staged = false;  // named with a pipeline rank (PP > 1)
};
std::optional<RankFolder> ParseRankFolder(const std::string& name);

// Blocks per pipeline stage: Megatron-LM gives every stage num_layers / PP
// consecutive blocks and refuses a PP that does not divide them.
Result<int> BlocksPerStage(int blocks, int pp);

// Where one weight goes.
struct ModelPlace {
  int stage = 0;
  // Keys from `model` down; the last is the tensor's key in its module's
  // state dict: {"language_model", "encoder", "layers.0.input_layernorm.weight"}.
  std::vector<std::string> path;
};

// The place of the weight `key` (module-local, as in the DeepSpeed layer
// file) of a layer of `role` — block `block` for blocks, whose ids are local
// to their stage — with `per_stage` blocks in each of `pp` stages.
Result<ModelPlace> PlaceOf(const std::string& role, const std::string& key, int block, int per_stage, int pp);

// The last stage's copy of a tied word embedding (PP > 1).
ModelPlace HeadEmbeddingPlace(int pp);

// The entry of the rule set's torch_dist section that names rank tensor `r`
// (its canonical name, {block} filled in); `target` is the export, for the message.
Result<const TorchDistTensor*> TorchDistEntryOf(const RuleSet& rules, const RankTensor& r, const std::string& target);

// Whether `t` is a word embedding tied to the output layer, which Megatron
// copies to the last pipeline stage at PP > 1.
bool IsTiedVocab(const RankTensor& t);

// The dtype `t` is written in: `dtype` for a floating tensor when given.
DType WrittenDType(const RankTensor& t, const std::optional<DType>& dtype);

// Megatron-Core's key of block `local_block` of a stage for a stacked
// torch_dist key: ("decoder.layers.mlp.linear_fc1.weight", 1) ->
// "decoder.layers.1.mlp.linear_fc1.weight", as a stage numbers its layers
// from 0.
Result<std::string> LayerKey(const std::string& stacked, int local_block);

// LayerKey backwards: "decoder.layers.1.mlp.linear_fc1.weight" ->
// {"decoder.layers.mlp.linear_fc1.weight", 1}; nullopt when `key` is not a
// layer's.
std::optional<std::pair<std::string, int>> SplitLayerKey(const std::string& key);

// Whether a torch_dist key or module is one per layer ("decoder.layers....").
bool IsLayerKey(const std::string& key);

// The stage holding a module outside the layers: the embedding's is the
// first (pre_process), the final norm's and output layer's the last.
int StageOfModule(const std::string& key, int pp);

}  // namespace reshard
