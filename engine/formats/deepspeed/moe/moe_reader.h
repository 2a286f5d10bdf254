// Reading a DeepSpeed MoE save into a LogicalCheckpoint.
//
// DeepSpeed saves a model with MoE layers without layer files: each
// mp_rank file's `module` holds the stage's (or the whole model's) tensors
// but the experts, and one file per MoE layer and expert holds that
// expert's tensors. The reader puts both back together as the layers a
// pipeline checkpoint's layer files would give, so the rule set describes
// expert tensors and gates like any other tensor:
//
//   pipeline engine   keys are `<spec>.<key>`: the spec id places the tensor
//   nn.Module         keys are module paths: the rule set's module_paths
//                     name the role and block
//
// The MoE layout (EP size, experts per layer, which blocks are MoE) is then
// read from the files and the metadata and cross-checked (moe_layout.h).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "formats/deepspeed/moe/moe_layout.h"
#include "formats/deepspeed/model/pipeline_reader.h"

namespace reshard {

struct MoeModel {
  std::unique_ptr<DeepSpeedModel> model;
  bool pipeline_names = true;  // `<spec>.<key>` names (the pipeline engine), else module paths
  MoeLayout layout;
};

// Reads the metadata, the mp_rank modules and the expert files, describes
// them with the rule set `options.rules` (a path or name; empty = detect)
// and discovers the MoE layout. A checkpoint whose files and metadata
// disagree is refused with one line (InvalidInput).
Result<MoeModel> ReadMoeModel(CheckpointFiles files, const CommonOptions& options);

}  // namespace reshard
