#include "formats/dcp_recipe/dcp_recipe_export.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "formats/fsdp2_dcp.h"
#include "formats/hf_common/hf_mapping.h"
#include "formats/hf_common/hf_tensors.h"
#include "formats/state_dict.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kDcpRecipe[] = "dcp_recipe";

// A top-level prefix: its keys' beginning ("app.model.", "" for none) and the
// keys torch nests its items under ("app", "model").
struct Prefix {
  std::string dotted;
  std::vector<Value> path;

  // The path of an item `rest` below the prefix.
  std::vector<Value> Path(std::vector<Value> rest) const {
    std::vector<Value> out = path;
    for (Value& v : rest) out.push_back(std::move(v));
    return out;
  }
};

struct Prefixes {
  Prefix model;
  Prefix optim;
};

Result<Prefix> ParsePrefix(const std::string& text, const std::string& option) {
  Prefix p;
  if (text.empty()) return p;
  for (size_t begin = 0, end = 0; begin <= text.size(); begin = end + 1) {
    end = std::min(text.find('.', begin), text.size());
    const std::string word = text.substr(begin, end - begin);
    if (word.empty()) {
      return Status::InvalidInput("--" + std::string(kRecipePrefixesOption) + " " + option + ": '" + text +
                                  "' has an empty key between its dots; give keys such as app.model");
    }
    p.path.push_back(Value::String(word));
  }
  p.dotted = text + ".";
  return p;
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

// The tensors `chosen` under their HF names.
Result<std::vector<StateDictTensor>> HfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                               const RuleInputs& inputs, OutputPlan* out) {
  int64_t scratch_bytes = 0;
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> tensors,
                           MapHfTensors(hf, chosen, inputs, out->scratch, &scratch_bytes));
  out->scratch_bytes = std::max(out->scratch_bytes, scratch_bytes);
  return tensors;
}

KeyedTensor Keyed(StateDictTensor t, std::string key, std::vector<Value> path) {
  return {std::move(key), t.dtype, std::move(t.shape), std::move(t.bytes), -1, std::move(t.detail), std::move(path)};
}

// The checkpoint being planned: the state dicts' items under their keys,
// each cut over the ranks.
class RecipeWriter {
 public:
  RecipeWriter(Prefixes prefixes, bool flat, int ranks)
      : prefixes_(std::move(prefixes)), flat_(flat), files_(Fsdp2Mesh{ranks, 1}) {}

  // The model's tensors, a tied head also under its own name (the module's
  // state dict holds both); returns how many.
  int AddModel(std::vector<StateDictTensor> model, const HfExport& hf, const std::vector<FullTensor>& all) {
    for (const auto& [copy, of] : hf.tied) {
      auto named = [](const std::string& name) { return [&name](const StateDictTensor& t) { return t.name == name; }; };
      auto it = std::find_if(model.begin(), model.end(), named(of));
      if (it == model.end() || std::any_of(model.begin(), model.end(), named(copy))) continue;
      StateDictTensor head = *it;
      head.name = copy;
      model.push_back(std::move(head));
    }
    for (StateDictTensor& t : model) {
      const std::string key = prefixes_.model.dotted + t.name;
      std::vector<Value> path = prefixes_.model.Path({Value::String(t.name)});
      files_.AddSharded(Keyed(std::move(t), key, std::move(path)), all);
    }
    return static_cast<int>(model.size());
  }

  // State `state` of parameter `fqn`, chunked like it (`t`: its bytes).
  void AddState(StateDictTensor t, const std::string& fqn, const std::string& state,
                const std::vector<FullTensor>& all) {
    files_.AddSharded(Keyed(std::move(t), StateKey(fqn, state), StatePath(fqn, state)), all);
  }

  void AddStep(const std::string& fqn, float step) {
    files_.AddStep(StateKey(fqn, "step"), step, StatePath(fqn, "step"));
  }

  // The param groups: each parameter's (flat), or one group per set of
  // hyperparameters, in the order of their first parameter (indexed).
  void AddGroups(const std::vector<std::pair<std::string, Items>>& fields_of) {
    const std::string groups = prefixes_.optim.dotted + "param_groups.";
    if (flat_) {
      for (const auto& [fqn, fields] : fields_of) {
        for (const auto& [name, value] : fields) {
          const std::string rest = "param_groups." + fqn + "." + name.as_string();
          AddObject(prefixes_.optim.dotted + rest, value, prefixes_.optim.Path({Value::String(rest)}));
        }
      }
      return;
    }
    std::vector<std::pair<Items, std::vector<Value>>> merged;  // hyperparameters, FQNs
    for (const auto& [fqn, fields] : fields_of) {
      const std::string shown = Value::MakeDict(fields).DebugString();
      auto same = std::find_if(merged.begin(), merged.end(),
                               [&](const auto& g) { return Value::MakeDict(g.first).DebugString() == shown; });
      if (same == merged.end()) same = merged.insert(merged.end(), {fields, {}});
      same->second.push_back(Value::String(fqn));
    }
    for (size_t i = 0; i < merged.size(); ++i) {
      Items fields = merged[i].first;
      fields.emplace_back(Value::String("params"), Value::MakeList(merged[i].second));
      for (const auto& [name, value] : fields) {
        const std::string key = groups + std::to_string(i) + "." + name.as_string();
        AddObject(key, value,
                  prefixes_.optim.Path({Value::String("param_groups"), Value::Int(static_cast<int64_t>(i)), name}));
      }
    }
  }

  Fsdp2Files& files() { return files_; }

 private:
  std::string StateKey(const std::string& fqn, const std::string& state) const {
    return prefixes_.optim.dotted + "state." + fqn + "." + state;
  }

  // torch's planner path of a state: nested (state, fqn, name), or one key
  // of the flattened optimizer state dict.
  std::vector<Value> StatePath(const std::string& fqn, const std::string& state) const {
    if (flat_) return prefixes_.optim.Path({Value::String("state." + fqn + "." + state)});
    return prefixes_.optim.Path({Value::String("state"), Value::String(fqn), Value::String(state)});
  }

  void AddObject(const std::string& key, const Value& value, std::vector<Value> path) {
    DcpWriteItem item = DcpBytesItem(key, value);
    item.path = std::move(path);
    files_.AddToRankZero(std::move(item));
  }

  const Prefixes prefixes_;
  const bool flat_;
  Fsdp2Files files_;
};

// The AdamW state of each parameter of `params`, under its HF tensors' names
// (a tied copy has none: it is no parameter of its own).
Status AddOptimizer(const SourceCheckpoint& src, const HfExport& hf, const std::vector<ChosenTensor>& params,
                    const RuleInputs& inputs, const std::vector<FullTensor>& all, OutputPlan* out,
                    RecipeWriter* writer, std::vector<std::string>* notes) {
  RESHARD_ASSIGN_OR_RETURN(OptimizerParamGroups groups, src.ParamGroupsAndStep());
  RESHARD_ASSIGN_OR_RETURN(float step, AdamwStep(groups));
  for (const std::string& moment : AdamwMoments()) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<ChosenTensor> states, AdamwMoment(all, params, moment, kDcpRecipe));
    RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> mapped, HfTensors(hf, states, inputs, out));
    for (StateDictTensor& t : mapped) {
      const std::string fqn = t.name;
      writer->AddState(std::move(t), fqn, moment, all);
    }
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> mapped, HfTensors(hf, params, inputs, out));
  std::vector<std::string> defaulted;
  std::vector<std::pair<std::string, Items>> fields_of;
  for (const StateDictTensor& t : mapped) {
    writer->AddStep(t.name, step);
    RESHARD_ASSIGN_OR_RETURN(Items fields, AdamwGroup(groups, CanonicalOfHf(hf, t.name), /*initial_lr_always=*/false, &defaulted));
    fields_of.emplace_back(t.name, std::move(fields));
  }
  writer->AddGroups(fields_of);
  NoteAdamwDefaults(kDcpRecipe, defaulted, notes);
  return Status::Ok();
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
  const auto& [hf, all, optimizer, params] = read;
  RecipeWriter writer(prefixes, form == kFlatGroups, static_cast<int>(ranks));
  RESHARD_ASSIGN_OR_RETURN(std::vector<StateDictTensor> model, HfTensors(*hf, params, inputs, &out));
  const int model_tensors = writer.AddModel(std::move(model), *hf, all);
  if (optimizer) RESHARD_RETURN_IF_ERROR(AddOptimizer(src, *hf, params, inputs, all, &out, &writer, notes));
  RESHARD_RETURN_IF_ERROR(writer.files().AddTo("", &out));
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
