#include "formats/dcp_recipe/dcp_recipe_export.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "formats/fsdp2_dcp.h"
#include "formats/state_dict.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kDcpRecipe[] = "dcp_recipe";

// The model's and the optimizer's prefixes, as --prefixes names them.
struct Prefixes {
  StateDictPrefix model;
  StateDictPrefix optim;
};

Result<StateDictPrefix> ParsePrefix(const std::string& text, const std::string& option) {
  std::vector<std::string> words;
  if (text.empty()) return StateDictPrefix{};
  for (size_t begin = 0, end = 0; begin <= text.size(); begin = end + 1) {
    end = std::min(text.find('.', begin), text.size());
    const std::string word = text.substr(begin, end - begin);
    if (word.empty()) {
      return Status::InvalidInput("--" + std::string(kRecipePrefixesOption) + " " + option + ": '" + text +
                                  "' has an empty key between its dots; give keys such as app.model");
    }
    words.push_back(word);
  }
  return StateDictPrefix::Of(words);
}

// The prefixes --prefixes MODEL,OPTIM names: OPTIM not empty (a model at the
// top level has MODEL empty), neither inside the other.
Result<Prefixes> ParsePrefixes(const std::string& option) {
  const size_t comma = option.find(',');
  if (comma == std::string::npos || option.find(',', comma + 1) != std::string::npos ||
      comma + 1 == option.size()) {
    return Status::InvalidInput("--" + std::string(kRecipePrefixesOption) + " " + option +
                                ": give MODEL,OPTIM, the top-level keys the model's and the optimizer's state dicts "
                                "are saved under (e.g. model,optim or app.model,app.optim)");
  }
  Prefixes p;
  RESHARD_ASSIGN_OR_RETURN(p.model, ParsePrefix(option.substr(0, comma), option));
  RESHARD_ASSIGN_OR_RETURN(p.optim, ParsePrefix(option.substr(comma + 1), option));
  if (!p.model.dotted.empty() &&
      (StartsWith(p.model.dotted, p.optim.dotted) || StartsWith(p.optim.dotted, p.model.dotted))) {
    return Status::InvalidInput("--" + std::string(kRecipePrefixesOption) + " " + option + ": the model's and the "
                                "optimizer's keys would mix; give two prefixes neither of which holds the other");
  }
  return p;
}

Result<OutputPlan> PlanDcpRecipe(const SourceCheckpoint& src, const ExportOptions& options,
                                 std::vector<std::string>* notes) {
  const int64_t ranks = FormatCount(options, kDpShardOption);
  if (ranks < 1) {
    return Status::InvalidInput("export --to dcp_recipe needs --dp-shard N (>= 1), the FSDP2 world size the "
                                "parameters are sharded over");
  }
  const std::string prefix_option = FormatOption(options, kRecipePrefixesOption);
  RESHARD_ASSIGN_OR_RETURN(Prefixes prefixes, ParsePrefixes(prefix_option));
  const std::string form = FormatOption(options, kRecipeGroupsOption);
  const RuleInputs inputs{src.info().metadata, src.info().settings};
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(Fsdp2Source read, ReadFsdp2Source(src, inputs, options, kDcpRecipe, &out, notes));
  Fsdp2Files files(Fsdp2Mesh{static_cast<int>(ranks), 1});
  Fsdp2StateDictWriter writer(prefixes.model, prefixes.optim, form == kFlatGroups, &files, &files);
  RESHARD_ASSIGN_OR_RETURN(const int model_tensors, writer.AddModel(read, inputs, &out));
  const bool optimizer = read.optimizer;
  if (optimizer) RESHARD_RETURN_IF_ERROR(writer.AddOptimizer(src, read, inputs, kDcpRecipe, &out, notes));
  RESHARD_RETURN_IF_ERROR(files.AddTo("", &out));
  const size_t comma = prefix_option.find(',');
  out.summary = "dcp_recipe: FSDP2 Shard(0) over " + Count(ranks, "rank") + "; " + Count(model_tensors, "model tensor") +
                " under " + (comma == 0 ? "the top level" : prefix_option.substr(0, comma)) +
                (optimizer ? "; AdamW state under " + prefix_option.substr(comma + 1) +
                                 " (exp_avg, exp_avg_sq, step, param_groups " + form + ")"
                           : "; weights only") +
                "\n";
  notes->push_back("dcp_recipe: the model and its optimizer only, as get_state_dict gives them; like the recipe's "
                   "saves it records no model config, which reading it back takes from --set");
  return out;
}

}  // namespace

TargetFormat DcpRecipeTarget() {
  TargetFormatInfo info{kDcpRecipe,
                        "a model and its AdamW state as PyTorch's DCP recipe saves them (get_state_dict, dcp.save), "
                        "FSDP2 over --dp-shard ranks",
                        "the checkpoint folder itself (dcp.save's checkpoint_id)"};
  info.options = {DpShardOption(),
                  {kRecipePrefixesOption, FormatOptionInfo::Kind::kText,
                   "MODEL,OPTIM: the top-level keys the model's and the optimizer's state dicts are saved under, a "
                   "dotted one nesting (app.model,app.optim: the tutorial's AppState); a recipe source's own by "
                   "default",
                   {}, false, "model,optim"},
                  {kRecipeGroupsOption, FormatOptionInfo::Kind::kText,
                   "The optimizer's param groups as get_state_dict gives them (indexed: OPTIM.param_groups.<i>, "
                   "with the group's FQNs in .params) or flattened (flat: flatten_optimizer_state_dict=True, "
                   "OPTIM.param_groups.<fqn>); a recipe source's own by default",
                   {kIndexedGroups, kFlatGroups}, false, kIndexedGroups},
                  FromOption("masters"), DTypeOption()};
  return {std::move(info), PlanDcpRecipe};
}

}  // namespace reshard
