// The `torch_dist` section of a rule file (rules/rule_section.h): each
// canonical tensor's key in Megatron-Core's `torch_dist` checkpoints and in
// Megatron-LM's `torch` format, for each layer spec, and the args values the
// family's rules read under Megatron-Core's names.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "rules/rule_reader.h"
#include "rules/rule_section.h"
#include "rules/rule_set.h"

namespace reshard {

// One args value a torch_dist import records under the name these rules
// read (`torch_dist.args`): Megatron-Core's args name some values otherwise
// (num_query_groups for num_key_value_heads). Read from `from` (a metadata
// path), or the literal `value`, when `when` holds.
struct TorchDistArg {
  int line = 0;
  std::string set;   // the args field the rules read
  std::string from;  // "" when `value` gives it
  std::shared_ptr<const Value> value;
  ArgConditions when;
};

// One canonical tensor of a Megatron-Core `torch_dist` checkpoint
// (`torch_dist.tensors`): a name with {block} is one tensor per transformer
// block, stacked in the checkpoint on a leading layer axis; one with
// {expert} too is one per block and expert, the experts stacked on the axis
// after the layer axis (the one expert parallelism splits).
struct TorchDistTensor {
  int line = 0;
  std::string name;               // canonical: 'layers.{block}.self_attention.dense.weight'
  std::vector<std::string> keys;  // the checkpoint's key; alternatives, as Megatron-Core versions name it
  // The key of the local layer spec's module (`local:`), when it is not
  // keys[0]: Transformer Engine fuses the norms into the linear layers
  // (`linear_qkv.layer_norm_weight`), the local spec keeps them as modules
  // (`input_layernorm.weight`). Also the last of `keys`, for reading.
  std::string local_key;
  // The canonical tensor's shape, as hf.tensors writes one (N, path, N*path,
  // *). A path the checkpoint does not record takes the size it meets first.
  std::vector<std::string> shape;
};

// Megatron-Core's layer specs, whose modules name some tensors differently.
enum class LayerSpec { kLocal, kTransformerEngine };

// The Megatron-LM args fields that say how a run split its layers over the
// pipeline stages (the first and last stage's layers, the embedding and the
// loss counted as layers), which a torch_dist import reads beside a
// section's args: its optimizer state's layout follows them.
inline constexpr const char* kPipelineSplitArgs[] = {
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"};

// How the family's models are stored by Megatron-Core's `torch_dist`, and
// the keys of Megatron-LM's `torch` format (one state_dict() per rank).
struct TorchDistLayout : RuleSection {
  static constexpr char kName[] = "torch_dist";
  // What a torch_dist import reads: Megatron-Core's args, the shapes' sizes,
  // and how the run split its layers over the pipeline stages (Megatron-LM's
  // args, which its optimizer state's layout follows).
  void AddValuePaths(std::set<std::string>* paths) const override;

  int line = 0;
  std::vector<TorchDistArg> args;
  std::vector<TorchDistTensor> tensors;
  // The modules (keys without `._extra_state`, stacked like block tensors)
  // whose per-layer `_extra_state` Megatron-Core saves and loads: written
  // empty by a torch_dist target, as a model without Transformer Engine's
  // FP8 state holds it.
  std::vector<std::string> extra_state;
  // The same for the experts' modules (`expert_extra_state`), saved per
  // layer and expert (SequentialMLP's local experts).
  std::vector<std::string> expert_extra_state;
  // `optimizer_order`: the order in which the model registers its parameters
  // (Megatron's `named_parameters()`), by checkpoint key, which no checkpoint
  // records and the distributed optimizer's flat `dp_reshardable` buffers
  // follow (reversed). The keys of block tensors form one run: a layer's
  // parameters, repeated for every layer of a pipeline stage, between the
  // keys of the first stage and those of the last. Alternative keys of one
  // tensor stand at its place. Empty when the section gives none.
  std::vector<std::string> optimizer_order;
  // Megatron-LM's `torch` format keeps every module's `_extra_state`, so
  // more than torch_dist: Megatron-Core's own modules that torch_dist drops
  // (`torch_extra_state`: the output layer), and in the TE spec Transformer
  // Engine's other modules (`te_extra_state`: attention, final norm).
  std::vector<std::string> torch_extra_state;
  std::vector<std::string> te_extra_state;
  // The key of the last stage's copy of a tied word embedding (PP > 1), in
  // the `torch` format; empty when the family has no tied embedding.
  std::string tied_head;

  // The key `tensor` is held under by `spec`'s modules (stacked: no layer index).
  static const std::string& KeyOf(const TorchDistTensor& tensor, LayerSpec spec) {
    return spec == LayerSpec::kLocal && !tensor.local_key.empty() ? tensor.local_key : tensor.keys.front();
  }
  // Whether `key` is a key (any alternative) of a block tensor: one stacked
  // over the layers.
  bool IsStackedKey(const std::string& key) const;
  // Whether `key` is a key of an expert's tensor: stacked over the layers
  // and, on the axis after, the experts.
  bool IsExpertKey(const std::string& key) const;
};

// Parses the section (RuleSectionParser::parse).
std::shared_ptr<const RuleSection> ParseTorchDistSection(const Field& section, const RuleSet& so_far, RuleReader* in);

}  // namespace reshard
