#include "formats/megatron_core/common/torch_dist_rules.h"

#include <re2/re2.h>

#include <algorithm>
#include <map>

#include "pickle/value.h"

namespace reshard {
namespace {

const std::vector<std::string> kTorchDistFields = {"args",       "tensors",           "extra_state", "optimizer_order",
                                                   "torch_extra_state", "te_extra_state", "tied_head",
                                                   "expert_extra_state"};
const std::vector<std::string> kTorchDistArgFields = {"from", "value", "when"};
const std::vector<std::string> kTorchDistTensorFields = {"name", "key", "local", "shape"};

class TorchDistSectionParser : RuleReader {
 public:
  explicit TorchDistSectionParser(const RuleReader& in) : RuleReader(in) {}

  std::shared_ptr<const RuleSection> Parse(const Field& f) {
    auto fields = ReadFields(f, "torch_dist", kTorchDistFields);
    if (!fields) return nullptr;
    TorchDistLayout layout;
    layout.line = f.line;
    if (const Field* a = Get(*fields, "args")) layout.args = ParseTorchDistArgs(*a);
    if (const Field* e = Get(*fields, "extra_state")) layout.extra_state = ReadStringList(*e, "torch_dist.extra_state");
    if (const Field* e = Get(*fields, "expert_extra_state")) {
      layout.expert_extra_state = ReadStringList(*e, "torch_dist.expert_extra_state");
    }
    if (const Field* e = Get(*fields, "torch_extra_state")) {
      layout.torch_extra_state = ReadStringList(*e, "torch_dist.torch_extra_state");
    }
    if (const Field* e = Get(*fields, "te_extra_state")) layout.te_extra_state = ReadStringList(*e, "torch_dist.te_extra_state");
    if (const Field* h = Get(*fields, "tied_head")) layout.tied_head = ReadString(*h, "torch_dist.tied_head").value_or("");
    const Field* t = Get(*fields, "tensors");
    if (t == nullptr || !t->node.IsSequence() || t->node.size() == 0) {
      Fail(t ? *t : f, "torch_dist.tensors must be a non-empty list of {name: <canonical name>, key: <torch_dist key "
                       "or list of alternatives>}");
      return nullptr;
    }
    std::map<std::string, int> names;
    for (const Field& item : Items(*t)) {
      std::optional<TorchDistTensor> tensor = ParseTorchDistTensor(item);
      if (!tensor) continue;
      if (!names.emplace(tensor->name, item.line).second) {
        Fail(item, "torch_dist.tensors maps '" + tensor->name + "' twice (first at line " +
                       std::to_string(names[tensor->name]) + "); keep one");
        continue;
      }
      layout.tensors.push_back(std::move(*tensor));
    }
    if (const Field* order = Get(*fields, "optimizer_order")) {
      layout.optimizer_order = ParseOptimizerOrder(*order, layout.tensors);
    }
    return std::make_shared<const TorchDistLayout>(std::move(layout));
  }

 private:
  // The keys of `tensors` in registration order: each a key of one entry,
  // once; the block keys in one run; every entry placed.
  std::vector<std::string> ParseOptimizerOrder(const Field& f, const std::vector<TorchDistTensor>& tensors) {
    const std::string what = "torch_dist.optimizer_order";
    std::vector<std::string> order = ReadStringList(f, what);
    if (f.node.IsSequence() && order.empty()) Fail(f, what + " is an empty list; list the model's keys in registration order");
    std::map<std::string, const TorchDistTensor*> entry_of;
    for (const TorchDistTensor& t : tensors) {
      for (const std::string& key : t.keys) entry_of[key] = &t;
    }
    std::set<std::string> seen;
    std::set<const TorchDistTensor*> placed;
    int block_runs = 0;
    bool in_blocks = false;
    for (const std::string& key : order) {
      auto it = entry_of.find(key);
      if (it == entry_of.end()) {
        Fail(f, what + " names '" + key + "', which no torch_dist.tensors entry has as its key; list the section's keys only");
        continue;
      }
      if (!seen.insert(key).second) Fail(f, what + " lists '" + key + "' twice; keep its first place");
      placed.insert(it->second);
      const bool block = it->second->name.find("{block}") != std::string::npos;
      block_runs += block && !in_blocks;
      in_blocks = block;
    }
    if (block_runs > 1) {
      Fail(f, what + " interleaves the block keys with others; list one layer's keys together (they repeat for "
              "every layer, between the first stage's keys and the last stage's)");
    }
    for (const TorchDistTensor& t : tensors) {
      if (!order.empty() && !placed.count(&t)) {
        Fail(f, what + " gives no place to '" + t.name + "' (line " + std::to_string(t.line) + "); add its key " +
                    t.keys[0] + " where the model registers it");
      }
    }
    return order;
  }

  // args field -> a metadata path, or {from: path | value: scalar, when: {...}}.
  std::vector<TorchDistArg> ParseTorchDistArgs(const Field& f) {
    std::vector<TorchDistArg> out;
    if (!f.node.IsMap()) {
      Fail(f, "torch_dist.args must be a mapping of args field -> metadata path or {from: path, when: {...}}");
      return out;
    }
    for (const auto& kv : f.node) {
      Field value{kv.second, LineOf(kv.first, f.line)};
      TorchDistArg arg;
      arg.line = value.line;
      arg.set = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      const std::string what = "torch_dist.args." + arg.set;
      if (!IsIdentifier(arg.set)) {
        Fail(value, "torch_dist.args key '" + arg.set + "' must be an args field name");
        continue;
      }
      if (value.node.IsScalar()) {
        arg.from = value.node.Scalar();
      } else if (auto fields = ReadFields(value, what, kTorchDistArgFields)) {
        const Field* from = Get(*fields, "from");
        const Field* literal = Get(*fields, "value");
        if ((from == nullptr) == (literal == nullptr)) {
          Fail(value, what + " needs one of from: <metadata path> and value: <scalar>");
          continue;
        }
        if (from) arg.from = ReadString(*from, what + ".from").value_or("");
        if (literal) arg.value = std::make_shared<const Value>(Literal(literal->node));
        if (const Field* when = Get(*fields, "when")) arg.when = ReadArgConditions(*when, what + ".when");
      }
      if (arg.value == nullptr && arg.from.find('.') == std::string::npos) {
        Fail(value, what + " must name a metadata path, e.g. args.num_query_groups");
        continue;
      }
      out.push_back(std::move(arg));
    }
    return out;
  }

  std::optional<TorchDistTensor> ParseTorchDistTensor(const Field& f) {
    const size_t errors_before = error_count();
    auto fields = ReadFields(f, "a torch_dist.tensors entry", kTorchDistTensorFields);
    if (!fields) return std::nullopt;
    TorchDistTensor t;
    t.line = f.line;
    const Field* name = Get(*fields, "name");
    const Field* key = Get(*fields, "key");
    if (name == nullptr || key == nullptr) {
      Fail(f, "a torch_dist.tensors entry needs name: <canonical name> and key: <torch_dist key or list of "
              "alternatives>");
      return std::nullopt;
    }
    if (auto s = ReadString(*name, "torch_dist.tensors name")) t.name = *s;
    CheckTorchDistTemplate(*name, t.name);
    if (key->node.IsSequence()) {
      t.keys = ReadStringList(*key, "torch_dist.tensors key");
    } else if (auto s = ReadString(*key, "torch_dist.tensors key")) {
      t.keys.push_back(*s);
    }
    if (const Field* local = Get(*fields, "local")) {
      t.local_key = ReadString(*local, "torch_dist.tensors local").value_or("");
      // A torch_dist save of another version may name it so too.
      if (std::find(t.keys.begin(), t.keys.end(), t.local_key) == t.keys.end()) t.keys.push_back(t.local_key);
    }
    for (const std::string& k : t.keys) {
      if (k.find('{') != std::string::npos) {
        Fail(*key, "torch_dist key '" + k + "' has a placeholder; Megatron-Core stacks the blocks of one key on "
                   "its first axis, so the key names them all");
      }
    }
    if (const Field* shape = Get(*fields, "shape")) t.shape = ReadShape(*shape, "torch_dist.tensors shape");
    if (error_count() != errors_before) return std::nullopt;
    return t;
  }
  // Checks a torch_dist name template: {block}, and {expert} after it (the
  // key stacks the experts on the axis after the layer axis).
  void CheckTorchDistTemplate(const Field& f, const std::string& name) {
    static const RE2 re("([^{}]|\\{block\\}|\\{expert\\})+");
    const size_t block = name.find("{block}"), expert = name.find("{expert}");
    if (!RE2::FullMatch(name, re)) {
      Fail(f, "torch_dist tensor name '" + name + "': the placeholders are {block} (the 0-based block) and "
              "{expert} (the 0-based global expert)");
    } else if (expert != std::string::npos && (block == std::string::npos || block > expert ||
                                                name.find("{expert}", expert + 1) != std::string::npos)) {
      Fail(f, "torch_dist tensor name '" + name + "' has {expert} without {block} before it; Megatron-Core stacks "
              "a MoE layer's experts on the axis after the layer axis");
    }
  }
};

// Whether the canonical name of the tensor of `key` holds `placeholder`.
bool NameOfKeyHas(const std::vector<TorchDistTensor>& tensors, const std::string& key, const char* placeholder) {
  for (const TorchDistTensor& t : tensors) {
    if (std::find(t.keys.begin(), t.keys.end(), key) != t.keys.end() || t.local_key == key) {
      return t.name.find(placeholder) != std::string::npos;
    }
  }
  return false;
}

}  // namespace

std::shared_ptr<const RuleSection> ParseTorchDistSection(const Field& section, const RuleSet& so_far, RuleReader* in) {
  return TorchDistSectionParser(*in).Parse(section);
}

void TorchDistLayout::AddValuePaths(std::set<std::string>* paths) const {
  for (const char* field : kPipelineSplitArgs) paths->insert(std::string("args.") + field);
  for (const TorchDistArg& arg : args) {
    if (!arg.from.empty()) paths->insert(arg.from);
    AddConditionPaths(arg.when, paths);
  }
  for (const TorchDistTensor& t : tensors) AddShapePaths(t.shape, paths);
}

bool TorchDistLayout::IsStackedKey(const std::string& key) const { return NameOfKeyHas(tensors, key, "{block}"); }

bool TorchDistLayout::IsExpertKey(const std::string& key) const { return NameOfKeyHas(tensors, key, "{expert}"); }

}  // namespace reshard
