// A DCP folder saved following PyTorch's Distributed Checkpoint recipe: a
// model's state dict and its optimizer's, as torch's
// `get_state_dict(model, optimizer)` gives them (FSDP2 DTensors or plain
// tensors), under two top-level prefixes: `model` / `optim` (torch's recipe),
// `app.model` / `app.optim` (the tutorial's AppState), or a user's own. It is
// read as the pipeline model of the family whose HF module has the model's
// keys (an HF transformers model's state dict: the rule file's HF names),
// with its Adam/AdamW state, by hf_common/state_dict_import.h, which
// torchtitan's import shares.
//
// The prefixes are found by the folder's structure: an optimizer's
// `<Q>.state.<fqn>.<state>` tensors beside its `<Q>.param_groups...` objects,
// and a model prefix P under which every such <fqn> is a tensor. A folder
// holding more than one such pair is refused naming them; the option
// CommonOptions::state_dict_prefixes (--state-dict-prefixes MODEL,OPTIM)
// names the pair to read.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "formats/hf_common/state_dict_import.h"
#include "reshard/reshard.h"

namespace reshard {

// The prefixes of a recipe save, each with its trailing dot ("" for a model
// at the top level; `optim` "" for a model saved alone).
struct RecipePrefixes {
  std::string model;
  std::string optim;
};

// The prefixes `option` names ("MODEL,OPTIM"), checked against `dcp`, or
// those its structure shows: a model beside its optimizer's state, or a
// model saved alone (`dcp.save({"model": model_sd})`, a weights-only
// conversion), every tensor under one prefix holding an HF module's keys of
// a family of `rules` (a path or built-in name; empty: every built-in one).
// nullopt when it is neither and no option is given. Errors (one line):
// more than one pair (naming them and the option), an option the folder
// does not fit.
Result<std::optional<RecipePrefixes>> FindRecipePrefixes(const DcpTensors& dcp, const std::string& option,
                                                         const std::string& rules);

// The options of export --to dcp_recipe (dcp_recipe_export.h) that write
// the save's form again: its prefixes and the form of its param groups.
std::map<std::string, std::string> RecipeSaveOptions(const DcpTensors& dcp, const RecipePrefixes& prefixes);

// Reads `dcp` under `prefixes` as the model of the first family that fits
// it. Errors (one line): a model key no family's HF names map, naming the
// rule-file section to add; ReadStateDictImport's others.
Result<StateDictImport> ReadDcpRecipeImport(const DcpTensors& dcp, const RecipePrefixes& prefixes,
                                            const CommonOptions& options);

}  // namespace reshard
