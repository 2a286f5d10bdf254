// The registry: the one place that knows every format. It opens a
// checkpoint with the format that recognises it (registry.cc), hands each
// format its section of a rule file (RuleSectionParsers, rules/rule_section.h,
// in rule_sections.cc) and plans a conversion or an export with the format `--to`
// names (targets.cc, the table of targets). The commands in engine/api/ reach the formats
// through it and through the interface in formats/format.h; it is the only
// file that includes format folders.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

// Opens the checkpoint at `path` (a tag folder, or a root holding `latest`)
// with the format that recognises it.
Result<std::unique_ptr<SourceCheckpoint>> OpenCheckpoint(const std::string& path,
                                                         const CommonOptions& options);

// The folder holding a checkpoint's files at `path`: `path` itself, or the
// checkpoint a format's pointer file in it names (a root holding `latest`).
std::string CheckpointFolder(const std::string& path);

// Refuses, naming the args field and the target that takes it, a `src` its
// rule set's Megatron-DeepSpeed model does not compute (`pipeline.requires`):
// what convert and the universal export check before writing that layout.
Status CheckPipelineComputes(const SourceCheckpoint& src);

// Ok when `to` names a format reshard writes; else InvalidInput in one
// line: "unknown target format 'HF'; did you mean 'hf'? (the formats: ...)".
Status CheckTargetFormat(const std::string& to);

// Whether `src` records the layout convert keeps of it when given no size:
// its TP, and the EP of a model with experts (a DeepSpeed MoE save's
// planner keeps its own).
bool RecordsItsLayout(const SourceCheckpoint& src);

// Plans convert's output: `src` in the format `options.to` names, else in its
// own, each layout size not given kept from the source.
Result<OutputPlan> PlanConvert(const SourceCheckpoint& src, const ConvertOptions& options,
                               std::vector<std::string>* notes);

// Plans `src` written in the format `options.to` names, once its options
// are checked against the target's declaration. `src` must outlive the
// plan and its jobs.
Result<OutputPlan> PlanExport(const SourceCheckpoint& src, const ExportOptions& options,
                              std::vector<std::string>* notes);

}  // namespace reshard
