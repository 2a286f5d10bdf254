// A model another format read (an HF folder, a Megatron-Core torch_dist or
// Megatron-LM torch checkpoint, a torchtitan step, a DCP recipe save, an
// Accelerate checkpoint), as plain data: its canonical tensors laid out by
// its rule set at TP 1, PP 1 (logical/imported_layers.h), its optimizer
// state, and what its format records of it.
//
// The registry hands it to formats/imported/, which presents it to every
// command in the terms of the format that read it; only a target that
// writes DeepSpeed's layout lays it out in DeepSpeed's files.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "logical/imported_layers.h"
#include "logical/imported_optimizer.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

struct ImportedModel {
  // The tensors, rules and metadata: args, iteration and the keys the rules
  // read, in no format's layout.
  LogicalCheckpoint logical;
  std::string dir;   // the folder it was read from
  std::string what;  // what it is ("Megatron-Core torch_dist checkpoint")
  std::vector<std::string> files;  // every file of it
  std::vector<std::string> notes;  // what reading it chose
  // Its optimizer state, where it has one reshard reads; else why not in
  // optimizer_status (ok and none: it has no optimizer state).
  std::optional<ImportedOptimizer> optimizer;
  Status optimizer_status;
  std::string format_version;  // SourceInfo::format_version
  RecordedFacts facts;         // what its format records of it, for inspect
  bool records_iteration = true;  // false for a format that keeps none (an HF folder)
};

}  // namespace reshard
