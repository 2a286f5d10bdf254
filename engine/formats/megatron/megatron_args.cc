#include "formats/megatron/megatron_args.h"

#include <algorithm>

#include "util/strings.h"

namespace reshard {
namespace {

// Modules every NVIDIA Megatron-LM environment imports: what torch.load of
// its checkpoints can always resolve.
bool StandardModule(const std::string& module) {
  static const char* const kRoots[] = {"builtins", "collections", "argparse", "copyreg", "torch", "numpy"};
  const std::string root = module.substr(0, module.find('.'));
  return std::find(std::begin(kRoots), std::end(kRoots), root) != std::end(kRoots);
}

bool Loadable(const Value& v);

bool AllLoadable(const std::vector<Value>& items) { return std::all_of(items.begin(), items.end(), Loadable); }

bool AllLoadable(const Items& items) {
  return std::all_of(items.begin(), items.end(),
                     [](const auto& kv) { return Loadable(kv.first) && Loadable(kv.second); });
}

// Whether torch.load in NVIDIA Megatron-LM rebuilds `v`. Tensors would, but
// the ones runs keep in args are CUDA buffers Megatron-LM rebuilds itself.
bool Loadable(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList: return AllLoadable(v.as_list().items);
    case Value::Kind::kTuple: return AllLoadable(v.as_tuple().items);
    case Value::Kind::kSet: return AllLoadable(v.as_set().items);
    case Value::Kind::kFrozenSet: return AllLoadable(v.as_frozenset().items);
    case Value::Kind::kDict: return AllLoadable(v.as_dict().items);
    case Value::Kind::kTensor: return false;
    case Value::Kind::kGlobal: return StandardModule(v.as_global().module);
    case Value::Kind::kObject: {
      const Object& o = v.as_object();
      return StandardModule(o.cls.module) && AllLoadable(o.args) && (!o.state || Loadable(*o.state)) &&
             AllLoadable(o.dict_items) && AllLoadable(o.list_items);
    }
    default: return true;
  }
}

// The member name of a fork's enum value: getattr(EnumClass, 'member') as
// Python >= 3.11 pickles it, or EnumClass(value) for the enum whose values
// are known; "" for anything else.
std::string EnumMember(const Value& v) {
  if (!v.is(Value::Kind::kObject)) return "";
  const Object& o = v.as_object();
  if (o.cls.Is("builtins", "getattr") && o.args.size() == 2 && o.args[0].is(Value::Kind::kGlobal) &&
      o.args[1].is(Value::Kind::kString)) {
    return o.args[1].as_string();
  }
  // BigScience's megatron/enums.py: rotary = 1, absolute = 2, alibi = 3.
  if (o.cls.Is("megatron.enums", "PositionEmbeddingType") && o.args.size() == 1 && o.args[0].is(Value::Kind::kInt)) {
    static const char* const kMembers[] = {"rotary", "absolute", "alibi"};
    const int64_t value = o.args[0].as_int();
    if (value >= 1 && value <= 3) return kMembers[value - 1];
  }
  return "";
}

// --position-embedding-type as NVIDIA Megatron-LM spells it.
std::string MegatronPositionType(const std::string& member) {
  if (member == "absolute") return "learned_absolute";
  if (member == "rotary") return "rope";
  return member;
}

}  // namespace

Value MegatronArgs(const Value& args, const MegatronLayout& layout, std::vector<std::string>* notes) {
  Value out = args;
  Items* items = MutableDictItems(out);
  Items kept;
  std::vector<std::string> dropped, renamed;
  std::string position;
  for (auto& [key, value] : *items) {
    const std::string name = key.is(Value::Kind::kString) ? key.as_string() : key.DebugString();
    if (Loadable(value)) {
      kept.emplace_back(std::move(key), std::move(value));
      continue;
    }
    std::string member = EnumMember(value);
    if (member.empty()) {
      dropped.push_back(name);
      continue;
    }
    if (name == "position_embedding_type") position = member = MegatronPositionType(member);
    renamed.push_back(name + "='" + member + "'");
    kept.emplace_back(std::move(key), Value::String(member));
  }
  *items = std::move(kept);
  // Megatron-LM's check_checkpoint_args reads add_position_embedding (True
  // when absent), which BigScience's runs express by the type alone.
  if (!position.empty() && Find(out, "add_position_embedding") == nullptr) {
    Set(out, "add_position_embedding", Value::Bool(position == "learned_absolute"));
    renamed.push_back(std::string("add_position_embedding=") + (position == "learned_absolute" ? "True" : "False"));
  }
  Set(out, "tensor_model_parallel_size", Value::Int(layout.tp));
  Set(out, "pipeline_model_parallel_size", Value::Int(layout.pp));
  Set(out, "data_parallel_size", Value::Int(layout.dp));
  Set(out, "world_size", Value::Int(int64_t{layout.tp} * layout.pp * layout.dp));
  if (layout.padded_vocab > 0) Set(out, "padded_vocab_size", Value::Int(layout.padded_vocab));
  if (!renamed.empty()) {
    notes->push_back("args: fork-only values made plain for Megatron-LM: " + Join(renamed, ", "));
  }
  if (!dropped.empty()) {
    notes->push_back("args: dropped " + std::to_string(dropped.size()) +
                     " field(s) NVIDIA Megatron-LM cannot unpickle or rebuilds itself (tensors, fork-only "
                     "classes): " + Join(dropped, ", "));
  }
  return out;
}

}  // namespace reshard
