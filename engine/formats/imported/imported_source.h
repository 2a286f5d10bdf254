// A model another format read (logical/imported_model.h) as a
// SourceCheckpoint: every command sees it in the terms of the format that
// read it (its files, its saved layout, its optimizer), and every target
// takes its tensors and optimizer state from here. Only the targets of
// DeepSpeed's layout (`deepspeed`, `universal`) lay it out in DeepSpeed's
// files, through the layout the registry hands over, made when one of them
// first plans it.
#pragma once

#include <functional>
#include <memory>

#include "formats/format.h"
#include "logical/imported_model.h"

namespace reshard {

// A model laid out as the source DeepSpeed's targets plan
// (formats/deepspeed/: MakeImportedSource).
using DeepSpeedLayout =
    std::function<std::unique_ptr<SourceCheckpoint>(ImportedModel model, const CommonOptions& options)>;

std::unique_ptr<SourceCheckpoint> MakeModelSource(ImportedModel model, const CommonOptions& options,
                                                  DeepSpeedLayout deepspeed);

}  // namespace reshard
