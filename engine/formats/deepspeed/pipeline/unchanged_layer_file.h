// Whether a target layer file is a source layer file as it lies, so that it
// is copied (cloned, where the file system can) instead of written again.
//
// A layer_NN-model_TT file holds layer NN's shards of TP rank TT, whatever
// the PP and DP sizes: under a PP- or DP-only change every one of its tensors
// is the source's, byte for byte, and writing the file again would only copy
// every byte through the process. A copy of the source file is then the
// target file; on a file system with reflinks it shares the source's extents.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

struct SourceFileCopy {
  std::string path;  // the source file
  // Whether the copy holds what the writer would write: a TP-replicated
  // tensor is written from TP rank 0's copy, so the file of another rank is
  // the target only where its replicas are rank 0's, byte for byte. It reads
  // them (norms, biases, position embeddings), so it is asked when the file
  // is written.
  std::function<bool()> holds;
};

// The source file that `file` would hold the content of, tensor for tensor
// (the same names, dtypes, shapes, bytes, devices and nothing else), where
// `file` may be a copy of it; nullopt where it must be written.
std::optional<SourceFileCopy> UnchangedSourceFile(const LogicalCheckpoint& src, const LayerFilePlan& file);

}  // namespace reshard
