// Reading a DeepSpeed tag folder's model files into a LogicalCheckpoint.
//
// The mp_rank files give the metadata of every (pipeline, tensor) rank; a
// pipeline checkpoint's layer files give the weights, one file per spec and
// TP rank. The rank grid the file names show is cross-checked against what
// the metadata records. A non-pipeline checkpoint (HF Trainer, Accelerate,
// --no-pipeline-parallel) keeps the whole model in each mp_rank file's
// `module`, numbered by TP rank: it has no layers and no rules.
#pragma once

#include <memory>
#include <set>
#include <string>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "logical/logical_checkpoint.h"
#include "pickle/value.h"

namespace reshard {

// A torch.save file of a DeepSpeed checkpoint: the classes DeepSpeed and
// Megatron pickle are known, `allowed_classes` are read (and never written).
Result<Value> ReadDeepSpeedFile(const std::string& path, const std::set<std::string>& allowed_classes);

struct DeepSpeedModel {
  CheckpointFiles files;
  bool pipeline = true;  // false: the whole model in the mp_rank files' `module`
  bool universal = false;  // a universal checkpoint (universal_reader.h)
  // A model another format read, laid out in DeepSpeed's files
  // (MakeImportedSource): it has no mp_rank files of its own, and what
  // writing its optimizer state as DeepSpeed's chose (its form) is a note for
  // a DeepSpeed target, which its Plan gives.
  bool imported = false;
  std::vector<std::string> imported_optimizer_notes;
  LogicalCheckpoint logical;
};

// Reads the mp_rank files into m->logical.metadata and checks that they are
// of one save (iteration).
Status ReadMetadata(const std::set<std::string>& allowed_classes, DeepSpeedModel* m);

// Reads the metadata and (for a pipeline checkpoint) the layer files and
// describes them with the rule set `options.rules` (a path or name; empty =
// detect), the --set values and the allowed classes of `options`.
Result<std::unique_ptr<DeepSpeedModel>> ReadDeepSpeedModel(CheckpointFiles files,
                                                           const CommonOptions& options);

}  // namespace reshard
