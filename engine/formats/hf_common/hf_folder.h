// A Hugging Face transformers model folder as files: config.json and the
// weights, in safetensors (model.safetensors, or shards named by
// model.safetensors.index.json) or torch.save files (pytorch_model.bin and
// its index), which transformers prefers in that order. Every tensor is
// bound to its bytes inside a memory map of its file; only the headers (and
// a .bin file's pickle, read by reshard's own reader) are read here.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "logical/source_shard.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

struct HfFolder {
  std::string dir;
  Value config;                          // config.json
  std::map<std::string, Value> tensors;  // every weight by name
  std::vector<std::string> order;        // their names as the weight files list them
  std::vector<std::string> files;        // config.json and the weight files
  // Tensors whose elements lie in runs (an HF model read from another
  // format's pieces): their `tensors` entry gives only dtype and shape.
  std::map<std::string, SourceShard> runs;
  // What the config is, for messages, when it is not files.front()'s
  // config.json; and how a missing field is given ("add it to config.json or
  // give" when empty).
  std::string config_label, config_fix;
  // What holds the tensors, for messages ("the HF folder" when empty).
  std::string tensors_label;
  std::string Label() const { return tensors_label.empty() ? "the HF folder" : tensors_label; }
  // "the HF folder's NAME", or the other format's ("... NAME (HF's name)").
  std::string Named(const std::string& name) const {
    return Label() + "'s " + name + (tensors_label.empty() ? "" : " (HF's name)");
  }
};

// Whether `path` is a folder holding config.json and weights transformers
// reads, and no `latest` (an HF Trainer checkpoint-N/ folder is read as the
// DeepSpeed checkpoint it holds).
bool IsHfFolder(const std::string& path);

// Whether `path` holds those weights without config.json (nor `latest`):
// what `export --to consolidated` writes, or a model whose config was left
// behind.
bool IsWeightsWithoutConfig(const std::string& path);

// A JSON file (config.json, a tokenizer's files) as Values.
Result<Value> ReadJsonFile(const std::string& path);

// Errors name the file and what is wrong with it: a weight index naming a
// tensor its file lacks (or leaving one out), a name in two files, a file
// that is not what its name says.
Result<HfFolder> ReadHfFolder(const std::string& dir);

// The same without config.json: `config` is left none.
Result<HfFolder> ReadWeightsWithoutConfig(const std::string& dir);

}  // namespace reshard
