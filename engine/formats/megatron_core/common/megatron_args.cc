#include "formats/megatron_core/common/megatron_args.h"

#include <algorithm>
#include <iterator>
#include <optional>

#include "formats/megatron_core/common/torch_dist_rules.h"
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

// ---- the architecture as NVIDIA Megatron-LM reads it ---------------------------
//
// Megatron-LM's --use-checkpoint-args (load_args_from_checkpoint, 0.17)
// copies the architecture fields from `args` over its own and then runs
// validate_args; its legacy model reads them. The fork spells some of them
// its own way, which that code rejects or ignores, so they are written as
// Megatron-LM spells them. Each rule below names the Megatron-LM behaviour
// it follows; `changes` learns every value written.

void Write(Value* args, const std::string& name, Value value, std::vector<std::string>* changes) {
  const Value* old = Find(*args, name);
  if (old != nullptr && old->DebugString() == value.DebugString()) return;
  changes->push_back(name + "=" + value.DebugString(40));
  Set(*args, name, std::move(value));
}

std::optional<int64_t> IntField(const Value& args, const char* name) {
  const Value* v = Find(args, name);
  if (v == nullptr || !v->is(Value::Kind::kInt)) return std::nullopt;
  return v->as_int();
}

bool BoolField(const Value& args, const char* name, bool absent) {
  const Value* v = Find(args, name);
  return v != nullptr && v->is(Value::Kind::kBool) ? v->as_bool() : absent;
}

// num_experts: an int, or None for no experts (validate_args compares it
// with ints). Microsoft's fork keeps a list per expert layer, [1] without MoE.
void NumExperts(Value* args, std::vector<std::string>* changes) {
  const Value* v = Find(*args, "num_experts");
  if (v == nullptr || !v->is(Value::Kind::kList)) return;
  const std::vector<Value>& counts = v->as_list().items;
  if (std::all_of(counts.begin(), counts.end(), [](const Value& n) { return n.is(Value::Kind::kInt) && n.as_int() == 1; })) {
    Write(args, "num_experts", Value::None(), changes);
  }
}

// normalization: 'LayerNorm' or 'RMSNorm' (the legacy model's get_norm
// refuses anything else); Microsoft's fork writes them in lower case.
void Normalization(Value* args, std::vector<std::string>* changes) {
  const Value* v = Find(*args, "normalization");
  if (v == nullptr || !v->is(Value::Kind::kString)) return;
  if (v->as_string() == "layernorm") Write(args, "normalization", Value::String("LayerNorm"), changes);
  if (v->as_string() == "rmsnorm") Write(args, "normalization", Value::String("RMSNorm"), changes);
}

// group_query_attention and num_query_groups (the legacy ParallelAttention
// and Megatron-Core read the groups only with the flag), from the group count
// the rules cut the weights with (`kv_groups`, else the args'
// num_key_value_heads: the fork's, an import's, or --set's; none:
// multi-head attention unless the args say otherwise). Args that already say
// group_query_attention keep it, and get the groups it needs.
void QueryGroups(Value* args, std::optional<int64_t> kv_groups, std::vector<std::string>* changes) {
  if (!kv_groups && Find(*args, "num_key_value_heads") == nullptr) return;
  if (!kv_groups) kv_groups = IntField(*args, "num_key_value_heads");
  const bool grouped = BoolField(*args, "group_query_attention", false) ||
                       (kv_groups && IntField(*args, "num_attention_heads") != kv_groups);
  if (grouped && !kv_groups) return;  // no group count to give: left as the run saved it
  Write(args, "group_query_attention", Value::Bool(grouped), changes);
  Write(args, "num_query_groups", grouped ? Value::Int(*kv_groups) : Value::None(), changes);
}

// position_embedding_type, which the legacy model builds positions from,
// where the fork says it with use_rotary_position_embeddings and
// add_position_embedding; then add_position_embedding True, Megatron-LM's own
// value unless its deprecated --no-position-embedding was given: its
// check_checkpoint_args compares it with that default, and validate_args
// refuses False with any type but rope. Args that say nothing of positions
// (or a type reshard could not read) are left as they are.
void PositionEmbedding(Value* args, std::vector<std::string>* changes) {
  const bool fork_fields =
      Find(*args, "use_rotary_position_embeddings") != nullptr || Find(*args, "add_position_embedding") != nullptr;
  if (Find(*args, "position_embedding_type") == nullptr && fork_fields) {
    const char* type = BoolField(*args, "use_rotary_position_embeddings", false) ? "rope"
                       : BoolField(*args, "add_position_embedding", true)      ? "learned_absolute"
                                                                               : "none";
    Write(args, "position_embedding_type", Value::String(type), changes);
  }
  if (Find(*args, "position_embedding_type") != nullptr) Write(args, "add_position_embedding", Value::Bool(true), changes);
}

// Megatron-LM's --rotary-base default.
constexpr int64_t kDefaultRotaryBase = 10000;

// rotary_base (an int, default 10000) from the fork's rope_theta.
void RotaryBase(Value* args, std::vector<std::string>* changes) {
  const Value* theta = Find(*args, "rope_theta");
  if (theta == nullptr || Find(*args, "rotary_base") != nullptr) return;
  if (theta->is(Value::Kind::kInt)) Write(args, "rotary_base", *theta, changes);
  if (theta->is(Value::Kind::kFloat)) {
    Write(args, "rotary_base", Value::Int(static_cast<int64_t>(theta->as_float())), changes);
  }
}

// The command-line flags that give Megatron-LM the architecture of `args`
// when it is loaded without --use-checkpoint-args.
std::vector<std::string> ArchitectureFlags(const Value& args) {
  std::vector<std::string> flags;
  // The types its --position-embedding-type takes besides the default
  // (BigScience's alibi is none of them: Megatron-LM does not compute it).
  static const char* const kTypes[] = {"rope", "mrope", "relative", "none"};
  const Value* type = Find(args, "position_embedding_type");
  if (type != nullptr && type->is(Value::Kind::kString) &&
      std::find(std::begin(kTypes), std::end(kTypes), type->as_string()) != std::end(kTypes)) {
    flags.push_back("--position-embedding-type " + type->as_string());
  }
  const Value* norm = Find(args, "normalization");
  if (norm != nullptr && norm->is(Value::Kind::kString) && norm->as_string() != "LayerNorm") {
    flags.push_back("--normalization " + norm->as_string());
  }
  if (BoolField(args, "swiglu", false)) flags.push_back("--swiglu");
  if (const std::optional<int64_t> groups = IntField(args, "num_query_groups");
      groups && *groups > 0 && BoolField(args, "group_query_attention", false)) {
    flags.push_back("--group-query-attention --num-query-groups " + std::to_string(*groups));
  }
  if (BoolField(args, "untie_embeddings_and_output_weights", false)) {
    flags.push_back("--untie-embeddings-and-output-weights");
  }
  if (!BoolField(args, "add_bias_linear", true)) flags.push_back("--disable-bias-linear");
  if (BoolField(args, "add_qkv_bias", false)) flags.push_back("--add-qkv-bias");
  if (BoolField(args, "qk_layernorm", false)) flags.push_back("--qk-layernorm");
  if (const std::optional<int64_t> channels = IntField(args, "kv_channels")) {
    const std::optional<int64_t> hidden = IntField(args, "hidden_size"), heads = IntField(args, "num_attention_heads");
    if (hidden && heads && *heads > 0 && *channels != *hidden / *heads) {
      flags.push_back("--kv-channels " + std::to_string(*channels));
    }
  }
  if (const std::optional<int64_t> experts = IntField(args, "num_experts"); experts && *experts > 0) {
    flags.push_back("--num-experts " + std::to_string(*experts));
    for (const char* size : {"moe_router_topk", "moe_ffn_hidden_size"}) {
      if (const std::optional<int64_t> n = IntField(args, size)) {
        std::string flag = std::string("--") + size;
        std::replace(flag.begin(), flag.end(), '_', '-');
        flags.push_back(flag + " " + std::to_string(*n));
      }
    }
    if (BoolField(args, "moe_router_pre_softmax", false)) flags.push_back("--moe-router-pre-softmax");
  }
  if (const std::optional<int64_t> base = IntField(args, "rotary_base"); base && *base != kDefaultRotaryBase) {
    flags.push_back("--rotary-base " + std::to_string(*base));
  }
  if (BoolField(args, "use_rope_scaling", false)) {
    const Value* factor = Find(args, "rope_scaling_factor");
    flags.push_back("--use-rope-scaling" + (factor != nullptr ? " --rope-scaling-factor " + factor->DebugString() : ""));
  }
  return flags;
}

// untie_embeddings_and_output_weights, from the rules the model was read
// with: a source whose args do not say it would otherwise be read back as
// the other model (Megatron-LM's default ties them).
void Tying(Value* args, std::optional<bool> tied, std::vector<std::string>* changes) {
  if (tied) Write(args, "untie_embeddings_and_output_weights", Value::Bool(!*tied), changes);
}

// The split's fields, where they differ from Megatron-LM's defaults (None,
// False) or the args hold them already (a source's split of another layout).
void WriteSplit(Value* args, const PipelineSplit& split) {
  auto size = [](const std::optional<int>& n) { return n ? Value::Int(*n) : Value::None(); };
  const Value values[] = {size(split.first), size(split.last), Value::Bool(split.embedding), Value::Bool(split.loss)};
  for (size_t i = 0; i < std::size(kPipelineSplitArgs); ++i) {
    const bool default_value = values[i].is_none() || (values[i].is(Value::Kind::kBool) && !values[i].as_bool());
    if (!default_value || Find(*args, kPipelineSplitArgs[i]) != nullptr) Set(*args, kPipelineSplitArgs[i], values[i]);
  }
}

// The virtual pipeline's fields, where not Megatron-LM's default (None) or
// the args hold them already (a source's virtual pipeline of another layout).
void WriteVpp(Value* args, int vpp) {
  const Value value = vpp > 1 ? Value::Int(vpp) : Value::None();
  for (const char* field : {kVppArg, "num_virtual_stages_per_pipeline_rank"}) {
    if (vpp > 1 || Find(*args, field) != nullptr) Set(*args, field, value);
  }
  if (Find(*args, "num_layers_per_virtual_pipeline_stage") != nullptr) {
    Set(*args, "num_layers_per_virtual_pipeline_stage", Value::None());
  }
}

// add_bias_linear and add_qkv_bias where the args do not say them (a source
// without Megatron args): from the tensors, as Megatron-LM's
// --disable-bias-linear and --add-qkv-bias would build the model.
void Biases(Value* args, const MegatronLayout& layout, std::vector<std::string>* changes) {
  if (!layout.linear_biases || Find(*args, "add_bias_linear") != nullptr) return;
  Write(args, "add_bias_linear", Value::Bool(*layout.linear_biases), changes);
  if (!*layout.linear_biases && layout.qkv_bias && Find(*args, "add_qkv_bias") == nullptr) {
    Write(args, "add_qkv_bias", Value::Bool(*layout.qkv_bias), changes);
  }
}

void AsMegatronLm(Value* args, const MegatronLayout& layout, std::vector<std::string>* notes) {
  std::vector<std::string> changes;
  Tying(args, layout.tied_embedding, &changes);
  Biases(args, layout, &changes);
  NumExperts(args, &changes);
  Normalization(args, &changes);
  QueryGroups(args, layout.kv_groups, &changes);
  PositionEmbedding(args, &changes);
  RotaryBase(args, &changes);
  if (!changes.empty()) {
    notes->push_back("args: the architecture written as NVIDIA Megatron-LM's --use-checkpoint-args reads it: " +
                     Join(changes, ", "));
  }
  const std::vector<std::string> flags = ArchitectureFlags(*args);
  notes->push_back("megatron: load with --use-checkpoint-args, or give the architecture on the command line" +
                   (flags.empty() ? std::string(" (the defaults, nothing to add)") : ": " + Join(flags, " ")));
}

}  // namespace

bool TiesEmbedding(const RuleSet& rules) {
  for (const auto& [role, params] : rules.layers()) {
    for (const ParamRule& rule : params) {
      if (rule.tied && rule.policy == ParamRule::Policy::kVocab && role == "embedding") return true;
    }
  }
  return false;
}

void ReadBiases(const std::vector<RankTensor>& tensors, MegatronLayout* layout) {
  // The canonical names of the linear layers' biases (docs/rules.md).
  static const char* const kLinear[] = {"self_attention.dense.bias", "mlp.dense_h_to_4h.bias",
                                        "mlp.dense_4h_to_h.bias"};
  bool linear = false, qkv = false;
  for (const RankTensor& t : tensors) {
    for (const char* suffix : kLinear) linear = linear || EndsWith(t.name, suffix);
    qkv = qkv || EndsWith(t.name, "self_attention.query_key_value.bias");
  }
  layout->linear_biases = linear;
  layout->qkv_bias = qkv;
}

std::optional<int64_t> KvGroups(const Value& metadata, const Value& settings) {
  const std::optional<int64_t> groups = MetaRef{{"args.num_key_value_heads"}}.Resolve(RuleInputs{metadata, settings});
  return groups && *groups > 0 ? groups : std::nullopt;
}

Value MegatronArgs(const Value& args, const MegatronLayout& layout, std::vector<std::string>* notes) {
  Value out = args;
  Items* items = MutableDictItems(out);
  Items kept;
  std::vector<std::string> dropped, renamed;
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
    if (name == "position_embedding_type") member = MegatronPositionType(member);
    renamed.push_back(name + "='" + member + "'");
    kept.emplace_back(std::move(key), Value::String(member));
  }
  *items = std::move(kept);
  Set(out, "tensor_model_parallel_size", Value::Int(layout.tp));
  Set(out, "pipeline_model_parallel_size", Value::Int(layout.pp));
  Set(out, "data_parallel_size", Value::Int(layout.dp));
  Set(out, "world_size", Value::Int(int64_t{layout.tp} * layout.pp * layout.dp));
  if (layout.padded_vocab > 0) Set(out, "padded_vocab_size", Value::Int(layout.padded_vocab));
  WriteSplit(&out, layout.split);
  WriteVpp(&out, layout.vpp);
  if (!renamed.empty()) {
    notes->push_back("args: fork-only values made plain for Megatron-LM: " + Join(renamed, ", "));
  }
  if (!dropped.empty()) {
    notes->push_back("args: dropped " + std::to_string(dropped.size()) +
                     " field(s) NVIDIA Megatron-LM cannot unpickle or rebuilds itself (tensors, fork-only "
                     "classes): " + Join(dropped, ", "));
  }
  AsMegatronLm(&out, layout, notes);
  return out;
}

}  // namespace reshard
