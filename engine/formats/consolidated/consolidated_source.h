// A folder of weight files without config.json as a source: what `export
// --to consolidated` writes (model.safetensors, its shards and index, or the
// same as pytorch_model*.bin), or a Hugging Face model whose config.json was
// left behind.
//
// Without a config no rule set can say what model the tensors are, so, like
// a Distributed Checkpoint read without rules (formats/dcp/dcp_source.h), it
// is read as what it is: every tensor whole under its key, its bytes in the
// memory map of its file. `inspect`, `lint`, `verify` and `export --to
// consolidated` work on it; convert and the other exports need the model's
// config.json beside the weights (the folder is then read as an HF model).
#pragma once

#include <memory>
#include <string>

#include "formats/format.h"

namespace reshard {

// Opens `dir`, a folder IsWeightsWithoutConfig (hf_folder.h) accepts.
// Errors name the file: a weight index and shards that disagree, a tensor
// stored non-contiguous or beyond its storage.
Result<std::unique_ptr<SourceCheckpoint>> OpenWeightsWithoutConfig(const std::string& dir);

}  // namespace reshard
