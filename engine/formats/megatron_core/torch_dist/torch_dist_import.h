// A Megatron-Core `torch_dist` checkpoint read as the pipeline model its
// family's rules describe, at TP 1, PP 1: what convert writes at any
// Megatron-DeepSpeed layout, and what lint, inspect, verify and the exports
// read like any checkpoint.
//
// The family is the rule set whose `torch_dist` section maps every model
// key of the checkpoint and whose shapes and conditions the checkpoint meets
// (or --rules). Each key is read as the canonical tensor(s) the section
// names: a block tensor's key is stacked on a leading layer axis, and block
// l's tensor is its slice l, assembled from the chunks (the TP and PP pieces)
// as runs of their bytes, so nothing is copied; a key of a name with
// {expert} stacks each layer's experts on its second axis (the EP pieces),
// expert e of layer l its slice [l, e]. Megatron-Core's fused QKV
// ([groups, q per group + 2, head dim] per TP rank) and SwiGLU linear_fc1
// ([all gate; all up]) are laid out as the canonical tensors are.
//
// Metadata: the args and iteration of the common state (common.pt, or the
// common_state item of Megatron-Core 0.19), the sizes the section's shapes
// take from the tensors where the args do not record them, the args the
// section renames, and what the family's conditions need where nothing says
// otherwise (a note lists them).
//
// The distributed optimizer's state (torch_dist_optimizer.h: Megatron-Core
// 0.19's fully_reshardable and dp_reshardable layouts, 0.14's
// fully_sharded_model_space) is read into the
// same canonical tensors, each state of a key sliced as its weights are: the
// fp32 masters and Adam's moments, the param groups and the step. A layout
// reshard does not read is recorded as the reason, for the commands that
// need the state. Not read: Transformer Engine's _extra_state, which the
// Megatron-DeepSpeed layer files cannot hold (a note says it is dropped).
#pragma once

#include <string>
#include <vector>

#include "formats/dcp_common/dcp_content.h"
#include "logical/imported_layers.h"
#include "logical/imported_optimizer.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

struct TorchDistImport {
  LogicalCheckpoint logical;
  std::vector<std::string> files;  // every file of the checkpoint
  std::string what;                // "Megatron-Core torch_dist checkpoint (rule set megatron-llama, ...)"
  std::vector<std::string> notes;  // what the import chose or left out
  // The optimizer state, when the checkpoint holds one reshard reads; else
  // why not, in optimizer_status (ok when it holds none).
  std::optional<ImportedOptimizer> optimizer;
  Status optimizer_status;
  // The Megatron-Core version whose form the folder has: "0.14" (common.pt,
  // or the layout fully_sharded_model_space) or "0.19" (the common_state
  // item, or a layout of 0.19's).
  std::string megatron_core_version;
  // The layout it was saved at, as its args record it (0: not recorded);
  // ep only for a model with experts.
  int tp = 0, pp = 0, dp = 0, ep = 0;
  // Its form, optimizer layout, iteration and saved layout, for inspect.
  RecordedFacts facts;
};

// Reads `content` (a torch_dist folder) as the model of the first family
// that fits it. Errors: NotFound when no rule set has a torch_dist section
// mapping the keys (the message names each candidate's reason); the reason
// the --rules set does not fit; a common state that does not parse.
Result<TorchDistImport> ReadTorchDistImport(const DcpContent& content, const CommonOptions& options);

}  // namespace reshard
