// Reading a DeepSpeed universal checkpoint (reference §14) as a source:
//
//   TAG/mp_rank_XX_model_states.pt   copied from the checkpoint it was made from
//   TAG/zero/optimizer_state.pt      hyperparameters, loss scaler, ... (absent in
//                                    BigScience's older form)
//   TAG/zero/<param>/<state>.pt      {'param': the whole tensor, layout keys}
//   TAG/zero/<param>/step.pt         the optimizer step, where there is one
//
// It is read as a pipeline checkpoint at TP 1, PP 1 whose weights are the
// fp32 masters cast to the training dtype (what DeepSpeed's own loader does:
// it never reads bf16 weights from one). The parameter names give the layer
// files' keys (`<spec id>.<key>`; `tied_modules.<module>.<key>` belongs to
// the spec the rules tie it to); the rules describe them as they describe
// layer files, and the optimizer state is located in the per-parameter files.
// The layout keys of the files (cat_dim, ...) are not needed: the tensors are
// whole, and the rules say how to cut them.
#pragma once

#include <memory>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/optimizer/source_optimizer.h"
#include "reshard/reshard.h"

namespace reshard {

struct UniversalCheckpoint {
  std::unique_ptr<DeepSpeedModel> model;  // universal = true, weights_from_masters set
  // Null, with the reason in optimizer_status, for BigScience's older form,
  // which keeps no optimizer_state.pt (so no hyperparameters to write shards with).
  std::unique_ptr<SourceOptimizer> optimizer;
  Status optimizer_status;
};

// REQUIRES: files.IsUniversal(). Errors name the file and the fix.
Result<UniversalCheckpoint> ReadUniversalCheckpoint(CheckpointFiles files, const CommonOptions& options);

// The info finding lint gives for a universal checkpoint's optimizer state.
Finding UniversalOptimizerFinding(const SourceOptimizer& opt);

}  // namespace reshard
