#include "formats/dcp_recipe/dcp_recipe_import.h"

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "formats/dcp_recipe/dcp_recipe_export.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kState[] = "state.";
constexpr char kParamGroups[] = "param_groups.";
constexpr char kOption[] = "--state-dict-prefixes";

// A prefix as given ("app.model"), with its dot ("app.model."); "" stays "".
std::string Dotted(const std::string& prefix) { return prefix.empty() ? "" : prefix + "."; }

// A prefix as the messages show it: without its dot, "(top level)" for none.
std::string Shown(const std::string& prefix) {
  return prefix.empty() ? "(top level)" : prefix.substr(0, prefix.size() - 1);
}

// Every optimizer prefix Q of `dcp` (an object under Q param_groups.) with
// the FQNs its state holds (tensors Q state.<fqn>.<state>).
std::map<std::string, std::set<std::string>> OptimizerStates(const DcpTensors& dcp) {
  std::set<std::string> grouped;
  for (const std::string& object : dcp.objects) {
    for (size_t at = object.find(kParamGroups); at != std::string::npos; at = object.find(kParamGroups, at + 1)) {
      if (at == 0 || object[at - 1] == '.') grouped.insert(object.substr(0, at));
    }
  }
  std::map<std::string, std::set<std::string>> out;
  for (const std::string& optim : grouped) {
    for (const auto& [key, t] : dcp.tensors) {
      if (!StartsWith(key, optim + kState)) continue;
      const std::string rest = key.substr(optim.size() + sizeof(kState) - 1);
      const size_t dot = rest.rfind('.');
      if (dot != std::string::npos && dot > 0) out[optim].insert(rest.substr(0, dot));
    }
  }
  return out;
}

// Whether every FQN of `fqns` is a tensor under `model`.
bool HoldsAll(const DcpTensors& dcp, const std::string& model, const std::set<std::string>& fqns) {
  return std::all_of(fqns.begin(), fqns.end(), [&](const std::string& f) { return dcp.tensors.count(model + f) > 0; });
}

// The model prefixes under which every FQN of `fqns` is a tensor.
std::vector<std::string> ModelPrefixes(const DcpTensors& dcp, const std::string& optim,
                                       const std::set<std::string>& fqns) {
  const std::string& first = *fqns.begin();
  std::vector<std::string> out;
  for (const auto& [key, t] : dcp.tensors) {
    if (StartsWith(key, optim + kState) || key.size() < first.size()) continue;
    const size_t at = key.size() - first.size();
    if (key.compare(at, std::string::npos, first) != 0 || (at > 0 && key[at - 1] != '.')) continue;
    if (HoldsAll(dcp, key.substr(0, at), fqns)) out.push_back(key.substr(0, at));
  }
  return out;
}

// The prefixes `option` names, checked against the folder.
Result<RecipePrefixes> GivenPrefixes(const DcpTensors& dcp, const std::string& option) {
  const size_t comma = option.find(',');
  if (comma == std::string::npos || option.find(',', comma + 1) != std::string::npos) {
    return Status::InvalidInput(std::string(kOption) + " " + option + ": give MODEL,OPTIM, the two top-level "
                                "prefixes (e.g. model,optim or app.model,app.optim)");
  }
  RecipePrefixes p{Dotted(option.substr(0, comma)), Dotted(option.substr(comma + 1))};
  const auto states = OptimizerStates(dcp);
  auto it = states.find(p.optim);
  if (p.optim.empty() || it == states.end()) {
    return Status::InvalidInput(std::string(kOption) + " " + option + ": " + dcp.folder + " holds no optimizer "
                                "state under " + p.optim + kState + " beside " + p.optim + kParamGroups +
                                " (inspect --rules none lists its keys)");
  }
  if (!HoldsAll(dcp, p.model, it->second)) {
    return Status::InvalidInput(std::string(kOption) + " " + option + ": " + dcp.folder + " holds the parameters "
                                "of the optimizer's state " + p.optim + kState + "<fqn> not all under " +
                                Shown(p.model) + " (inspect --rules none lists its keys)");
  }
  return p;
}

// Where a recipe save under `prefixes` keeps its model and its optimizer,
// and how it names them (state_dict_import.h).
StateDictKeys RecipeKeys(const RecipePrefixes& prefixes) {
  StateDictKeys keys;
  keys.format = "dcp_recipe";
  keys.label = "DCP recipe checkpoint";
  keys.model_prefix = prefixes.model;
  keys.optim_prefix = prefixes.optim;
  keys.hf_keys = true;
  if (prefixes.model.empty()) {  // the model at the top level: everything but the optimizer is its
    keys.run_states = {prefixes.optim.substr(0, prefixes.optim.find('.'))};
  }
  return keys;
}

// A model saved alone: the first key segment every tensor has, when a
// family's HF names map keys under it.
std::optional<RecipePrefixes> ModelAlone(const DcpTensors& dcp, const std::string& rules) {
  if (dcp.tensors.empty()) return std::nullopt;
  const std::string& first = dcp.tensors.begin()->first;
  const RecipePrefixes alone{first.substr(0, first.find('.') + 1), ""};
  if (alone.model.empty()) return std::nullopt;
  for (const auto& [key, t] : dcp.tensors) {
    if (!StartsWith(key, alone.model)) return std::nullopt;
  }
  if (!HoldsSectionModelKey(dcp, RecipeKeys(alone), rules)) return std::nullopt;
  return alone;
}

}  // namespace

Result<std::optional<RecipePrefixes>> FindRecipePrefixes(const DcpTensors& dcp, const std::string& option,
                                                         const std::string& rules) {
  if (!option.empty()) {
    RESHARD_ASSIGN_OR_RETURN(RecipePrefixes given, GivenPrefixes(dcp, option));
    return std::optional<RecipePrefixes>(std::move(given));
  }
  std::vector<RecipePrefixes> found;
  for (const auto& [optim, fqns] : OptimizerStates(dcp)) {
    if (fqns.empty()) continue;
    for (const std::string& model : ModelPrefixes(dcp, optim, fqns)) found.push_back({model, optim});
  }
  if (found.empty()) return ModelAlone(dcp, rules);
  if (found.size() > 1) {
    std::vector<std::string> pairs;
    for (const RecipePrefixes& p : found) pairs.push_back(Shown(p.model) + "," + Shown(p.optim));
    return Status::InvalidInput("the DCP folder " + dcp.folder + " holds a model with its optimizer's state under "
                                "more than one pair of prefixes (" + Join(pairs, "; ") + "); name the pair to read "
                                "with " + kOption + " MODEL,OPTIM, or read it as plain DCP with --rules none");
  }
  return std::optional<RecipePrefixes>(found.front());
}

std::map<std::string, std::string> RecipeSaveOptions(const DcpTensors& dcp, const RecipePrefixes& prefixes) {
  // torch's own param groups list their FQNs in `<i>.params`; flattened ones have none.
  const std::string groups = prefixes.optim + kParamGroups;
  const std::string params = ".params";
  const bool indexed = std::any_of(dcp.objects.begin(), dcp.objects.end(), [&](const std::string& key) {
    int64_t index = 0;
    const size_t end = key.size() - params.size();
    return StartsWith(key, groups) && key.size() > groups.size() + params.size() && key.substr(end) == params &&
           ParseInt(key.substr(groups.size(), end - groups.size()), &index);
  });
  auto bare = [](const std::string& dotted) { return dotted.empty() ? dotted : dotted.substr(0, dotted.size() - 1); };
  // A model saved alone keeps its prefix; its optimizer's, should it get one, is torch's `optim`.
  const std::string optim = prefixes.optim.empty() ? "optim" : bare(prefixes.optim);
  return {{kRecipePrefixesOption, bare(prefixes.model) + "," + optim},
          {kRecipeGroupsOption, indexed ? kIndexedGroups : kFlatGroups}};
}

Result<StateDictImport> ReadDcpRecipeImport(const DcpTensors& dcp, const RecipePrefixes& prefixes,
                                            const CommonOptions& options) {
  Result<StateDictImport> imported = ReadStateDictImport(dcp, RecipeKeys(prefixes), options);
  if (imported.ok() || imported.status().code() != Status::Code::kUnsupported) return imported;
  return Status::Unsupported(imported.status().message() + "; the model's family needs a rule file whose hf section "
                             "names its HF model and whose torchtitan section gives its sizes (docs/rules.md), "
                             "given with --rules FILE");
}

}  // namespace reshard
