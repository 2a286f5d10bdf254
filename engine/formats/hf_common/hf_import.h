// An HF transformers folder read as a Megatron-DeepSpeed pipeline model at
// TP 1, PP 1, with no optimizer state: what `convert HF_FOLDER OUT --tp T
// --pp P` writes at any layout, and what lint, inspect, verify and the
// exports read like any checkpoint.
//
// The family is the rule set whose hf section names the folder's
// architecture (or --rules). That section is read backwards:
//   tensors   each entry's HF tensors are joined into its canonical tensor:
//             q, k and v back into the fused per-group QKV, gate and up back
//             into [gate; up], GPT-2's Conv1D matrices transposed back. A
//             join of rows is a list of runs into the mapped files, so
//             nothing is copied; only a transposed matrix is built in memory.
//   config    a field read from a metadata path sets that path; a literal
//             must be what config.json says (or be absent from it); a case
//             sets what its `when` says. hf.requires and the rule set's
//             detect.args set the args they name, and everything is then
//             checked as an export would check it.
// The vocabulary is as the HF tensors hold it, taken as unpadded: convert
// pads it for the target TP (to a multiple of make_vocab_size_divisible_by,
// Megatron's default 128 unless --set gives another). The metadata is in no
// format's layout: the args, the keys the rule set detects and reads, and
// iteration 0 (no optimizer, no RNG state).
#pragma once

#include <string>
#include <vector>

#include "formats/hf_common/hf_folder.h"
#include "logical/imported_layers.h"
#include "logical/logical_checkpoint.h"
#include "reshard/reshard.h"

namespace reshard {

struct HfImport {
  LogicalCheckpoint logical;
  std::vector<std::string> files;  // config.json and the weight files
  // "HF folder (LlamaForCausalLM, 2 weight files)": what the source is.
  std::string what;
  std::vector<std::string> notes;  // what the import chose that the user should know
  RecordedFacts facts;  // config.json's architecture values (ReadHfImport's), for inspect
};

// Errors (one line each): an architecture no rule set exports, a tensor the
// mapping has no place for or lacks, a config.json the tensors or the rules
// disagree with.
Result<HfImport> ReadHfImport(const std::string& dir, const CommonOptions& options);

// `folder` read as the model of `rules`: ReadHfImport's reading of one
// family, also for an HF model another format holds (its tensors as runs,
// a config made for it; hf_common/state_dict_import.h).
Result<HfImport> ImportHfModel(HfFolder folder, const RuleSet& rules, const CommonOptions& options);

// The canonical tensors `folder`'s tensors make as `rules`' hf.tensors join
// them, by name; `inputs` gives the sizes (the imported model's metadata).
// Also for per-element optimizer states, which are laid out as the weights.
Result<std::map<std::string, ImportedTensor>> JoinHfTensors(const HfFolder& folder, const RuleSet& rules,
                                                           const RuleInputs& inputs);

}  // namespace reshard
