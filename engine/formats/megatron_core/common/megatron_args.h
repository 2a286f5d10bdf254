// The `args` of an exported Megatron-LM checkpoint: the source run's
// argparse.Namespace, made loadable by NVIDIA Megatron-LM and rewritten for
// the target layout.
//
// Megatron-LM unpickles `args` with torch.load, so every class in it must be
// importable there: fields holding a fork's class (BigScience's
// megatron.enums, DeepSpeed objects) or tensors (Microsoft's CUDA
// `attn_mask`, `rotary_pos_emb`) cannot stay. Enum members become their
// names — position_embedding_type in Megatron-LM's spelling — and the rest
// is dropped. The architecture fields are then written as Megatron-LM's
// --use-checkpoint-args reads them (num_experts None for the fork's [1],
// normalization 'LayerNorm' / 'RMSNorm', group_query_attention and
// num_query_groups, position_embedding_type, add_position_embedding True,
// rotary_base, untie_embeddings_and_output_weights, add_bias_linear and
// add_qkv_bias where absent); the notes name every field changed or dropped, and the
// flags that give the architecture to a run without --use-checkpoint-args.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/format.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "pickle/value.h"
#include "rules/rule_set.h"

namespace reshard {

// The layout the args describe.
struct MegatronLayout {
  int tp = 1, pp = 1, dp = 1;
  int64_t padded_vocab = 0;  // 0: the model has no vocabulary; the field is kept
  // Whether the output layer is the word embedding, as the model's rules say
  // (nullopt: no rules say; the field is kept): written as
  // untie_embeddings_and_output_weights, which Megatron-LM and reshard's
  // readers take the model's head from.
  std::optional<bool> tied_embedding;
  // The KV-group count the model was read with (KvGroups; nullopt: none is
  // known), written as num_query_groups where the attention is grouped.
  std::optional<int64_t> kv_groups;
  // How the layers are split over the `pp` stages: written as Megatron-LM's
  // decoder_first_pipeline_num_layers, ... (kPipelineSplitArgs), each where
  // it differs from Megatron-LM's default or the args hold it already.
  PipelineSplit split;
  // The model chunks of each stage: written as virtual_pipeline_model_parallel_size
  // and num_virtual_stages_per_pipeline_rank (None for 1), where not 1 or the
  // args hold them already; num_layers_per_virtual_pipeline_stage, which
  // Megatron-LM does not take beside them, None.
  int vpp = 1;
  // Whether the model has linear-layer biases, and q/k/v biases (nullopt: not
  // known), as its tensors say (ReadBiases): written as add_bias_linear and
  // add_qkv_bias where the args do not say them, since Megatron-LM's default
  // builds every linear layer with a bias.
  std::optional<bool> linear_biases, qkv_bias;
};

// Sets `layout`'s biases from the canonical names of the model's `tensors`.
void ReadBiases(const std::vector<RankTensor>& tensors, MegatronLayout* layout);

// The KV-group count the rules read, args.num_key_value_heads, from the
// source's `metadata` or the --set `settings`: where a run's args leave it
// None, --set gives it.
std::optional<int64_t> KvGroups(const Value& metadata, const Value& settings);

// Whether `rules` tie the word embedding and the output layer.
bool TiesEmbedding(const RuleSet& rules);

// `args` (dict-like: an argparse.Namespace as pickled) for `layout`: the
// parallel sizes, the stage sizes, world size and padded vocabulary rewritten (added when
// absent, since Megatron-LM compares them at load), fork-only values made
// plain or dropped. Notes say what was dropped or renamed.
Value MegatronArgs(const Value& args, const MegatronLayout& layout, std::vector<std::string>* notes);

}  // namespace reshard
