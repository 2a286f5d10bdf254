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
#include "logical/imported_layers.h"
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
  // Set for a model read from another format (an HF folder): what it is,
  // as the summary names it, and what reading it chose for the user to know
  // (SourceInfo::notes). Its files are files.foreign_files.
  std::string foreign;
  std::vector<std::string> foreign_notes;
  // What writing it as a DeepSpeed checkpoint chose (its optimizer's form):
  // notes for a DeepSpeed target only, which its Plan gives.
  std::vector<std::string> foreign_deepspeed_notes;
  std::string foreign_optimizer_layout;  // SourceInfo::optimizer_layout
  std::string foreign_format_version;    // SourceInfo::format_version
  RecordedFacts foreign_facts;           // what inspect prints of it (imported_layers.h)
  bool foreign_records_iteration = true;  // false: the iteration is a fresh run's 0
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
