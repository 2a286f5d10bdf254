#include "formats/deepspeed/universal/universal_writer.h"

#include <functional>
#include <optional>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/model/stages.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "plan/materialize.h"
#include "plan/tensor_plan.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

// One zero/<param>/<state>.pt file.
struct StateFile {
  std::string param;  // the engine's parameter name
  std::string state;
  std::vector<int64_t> shape;  // whole, vocabulary padding stripped
  Items layout;                // cat_dim, param_n_sub_params, vocab_tensor
  // The whole tensor's bytes, made from the source's shards while it is
  // written; they add the bytes they read to *read.
  std::function<ByteProducer(std::atomic<int64_t>* read)> produce;
  std::string from;  // where its elements come from, for --dry-run
};

std::string StatePath(const std::string& param, const std::string& state) {
  return "zero/" + param + "/" + state + ".pt";
}

// The layout keys DeepSpeed's loader cuts `rule`'s tensors by.
Result<Items> LayoutKeys(const ParamRule& rule, const std::string& param) {
  Items keys;
  switch (rule.policy) {
    case ParamRule::Policy::kReplicated: return keys;
    case ParamRule::Policy::kVocab:
      keys.emplace_back(Value::String("cat_dim"), Value::Int(0));
      keys.emplace_back(Value::String("vocab_tensor"), Value::Bool(true));
      return keys;
    case ParamRule::Policy::kSplit: break;
  }
  if (rule.parts > 2) {
    return Status::Unsupported(param + " stacks " + std::to_string(rule.parts) +
                               " sub-parameters, which DeepSpeed's universal metadata (param_n_sub_params) "
                               "cannot describe beyond 2");
  }
  keys.emplace_back(Value::String("cat_dim"), Value::Int(rule.dim));
  if (rule.parts == 2) keys.emplace_back(Value::String("param_n_sub_params"), Value::Int(2));
  return keys;
}

// A pipeline parameter's state, merged over TP by `replicated`; the
// vocabulary's true rows are the first rows, so its producer is the padded
// tensor's, cut short.
Result<StateFile> MakeStateFile(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                ReplicatedPolicy replicated, std::optional<int64_t> vocab_size,
                                const std::string& param, const std::string& state) {
  RESHARD_ASSIGN_OR_RETURN(StateTensor st, LocateState(src, opt, param, state));
  const TensorPlan plan = PlanFullTensor(src, st.layer_index, st.tensor_index, replicated);
  StateFile f{param, state, st.tensor.full_shape, {}, nullptr, "optimizer " + state + ": " + DescribeSources(plan)};
  f.produce = [source = SourceTensor::Of(st.tensor), plan](std::atomic<int64_t>* read) {
    return RangeProducer(source, plan, read);
  };
  RESHARD_ASSIGN_OR_RETURN(f.layout, LayoutKeys(*st.tensor.rule, param));
  if (st.tensor.rule->policy == ParamRule::Policy::kVocab) {
    const std::optional<int64_t> rows = src.vocab.original_size ? src.vocab.original_size : vocab_size;
    if (!rows) {
      return Status::InvalidInput("universal checkpoints store vocabulary tensors without padding, and the "
                                  "true vocabulary size is " + src.rules->vocab_original_size().HowToGive() +
                                  " (or --vocab-size N)");
    }
    f.shape[0] = *rows;
  }
  return f;
}

// The optimizer step the first shard records, if any: per-parameter state
// `step`, else the first group's `step`.
const Value* FindStep(const Value& osd) {
  const Value* base = Find(osd, "base_optimizer_state");
  if (base == nullptr) return nullptr;
  if (const Value* state = Find(*base, "state")) {
    const Items* items = DictItems(*state);
    if (items != nullptr && !items->empty()) {
      if (const Value* step = Find(items->front().second, "step")) return step;
    }
  }
  const Value* groups = Find(*base, "param_groups");
  if (groups != nullptr && groups->is(Value::Kind::kList) && !groups->as_list().items.empty()) {
    return Find(groups->as_list().items.front(), "step");
  }
  return nullptr;
}

// zero/optimizer_state.pt: the first shard's optimizer state without its
// partitions, with the groups' hyperparameters as `param_groups`.
Result<Value> OptimizerStateFile(const Value& osd) {
  const Value* base = Find(osd, "base_optimizer_state");
  const Value* groups = base != nullptr ? Find(*base, "param_groups") : nullptr;
  if (groups == nullptr) {
    return Status::Unsupported("the optimizer shards keep no param_groups in base_optimizer_state, which "
                               "a universal checkpoint's optimizer_state.pt needs");
  }
  Value out = Value::MakeDict();
  for (const auto& [key, value] : *DictItems(osd)) {
    const std::string& k = key.as_string();
    if (k == "base_optimizer_state" || k == "single_partition_of_fp32_groups" || k == "param_slice_mappings") {
      continue;
    }
    Set(out, k, value);
  }
  Set(out, "param_groups", *groups);
  return out;
}

// Everything a universal checkpoint's folder holds, as plain data.
struct UniversalFiles {
  std::vector<std::pair<std::string, std::string>> copies;  // name in the folder, source path
  Value optimizer_state;       // zero/optimizer_state.pt
  std::vector<StateFile> states;
  std::optional<Value> step;   // a step.pt beside each fp32.pt
  // DeepSpeed's ZeRO-3 form: each state file is the bare flat tensor (no
  // dict, no layout keys).
  bool bare = false;
};

// {'param': the whole tensor, layout keys...}, or the bare tensor.
Value StateTree(const StateFile& f, bool bare, std::atomic<int64_t>* read) {
  Value tensor = MakeProducedTensor(DType::kFloat32, f.shape, f.produce(read));
  if (bare) return tensor;
  Items items;
  items.emplace_back(Value::String("param"), std::move(tensor));
  for (const auto& kv : f.layout) items.push_back(kv);
  return Value::MakeDict(std::move(items));
}

std::string LayoutText(const Items& layout) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : layout) keys.push_back(k.as_string() + "=" + v.DebugString());
  return Join(keys, " ");
}

std::string Summary(const UniversalFiles& files) {
  int64_t bytes = 0;
  for (const StateFile& f : files.states) bytes += ShapeNumel(f.shape) * 4;
  return std::string("universal") + (files.bare ? " (ZeRO-3 form)" : "") + ": " +
         Count(static_cast<int64_t>(files.copies.size()), "model-states file") + " copied, " +
         Count(static_cast<int64_t>(files.states.size()), "state file") + " (" + HumanBytes(bytes) + ")" +
         (files.step ? ", a step.pt per parameter" : "") + ", zero/optimizer_state.pt\n";
}

// The folder's files, named beside it by `latest_universal`, as DeepSpeed's
// ds_to_universal names its output for `load_universal_checkpoint`.
Result<OutputPlan> UniversalOutput(const UniversalFiles& files) {
  OutputPlan out;
  out.summary = Summary(files);
  out.publication.pointers = {PointerFile{"latest_universal", std::nullopt}};
  out.publication.root_markers.assign(std::begin(kRootPointers), std::end(kRootPointers));
  for (const auto& [name, path] : files.copies) out.files.push_back(CopiedFile(name, path, true));
  RESHARD_ASSIGN_OR_RETURN(PlannedFile optimizer, TorchFile("zero/optimizer_state.pt", "", files.optimizer_state));
  out.files.push_back(std::move(optimizer));
  for (const StateFile& f : files.states) {
    RESHARD_ASSIGN_OR_RETURN(PlannedFile state, TorchFile(StatePath(f.param, f.state), LayoutText(f.layout),
                                                          StateTree(f, files.bare, out.read.get())));
    for (PlannedTensor& t : state.tensors) t.from = f.from;  // the one tensor
    out.files.push_back(std::move(state));
    if (files.step && f.state == kMasterState) {
      RESHARD_ASSIGN_OR_RETURN(PlannedFile step, TorchFile(StatePath(f.param, "step"), "", *files.step));
      out.files.push_back(std::move(step));
    }
  }
  return out;
}

// A state stored whole in one shard (a TP-1 source), written as `shape`.
StateFile WholeState(const std::string& param, const std::string& state, std::vector<int64_t> shape,
                     SourceShard shard) {
  const int64_t numel = shard.numel();
  const std::string from = "optimizer " + state + ": " + Count(static_cast<int64_t>(shard.runs.size()), "run") +
                           " of the optimizer partitions from DP rank " + std::to_string(shard.at.dp);
  StateFile f{param, state, std::move(shape), {}, nullptr, from};
  f.produce = [source = SourceTensor{DType::kFloat32, {std::move(shard)}}, numel](std::atomic<int64_t>* read) {
    return RangeProducer(source, WholeShardPlan(0, numel), read);
  };
  return f;
}

// The ZeRO-1/2 and BF16 form of `states`: the mp_rank files copied, the
// optimizer state of the template shard, a step.pt where it records a step.
Result<OutputPlan> PlanStates(const SourceOptimizer& opt, const CheckpointFiles& files,
                                               std::vector<StateFile> states, std::vector<std::string>* notes) {
  const Value* osd = Find(opt.Template(), "optimizer_state_dict");
  if (osd == nullptr) return Status::Internal("the first optimizer shard has no optimizer_state_dict");
  UniversalFiles out;
  for (const auto& [mp, path] : files.mp_rank_files) out.copies.emplace_back(ModelStatesFileName(mp), path);
  RESHARD_ASSIGN_OR_RETURN(out.optimizer_state, OptimizerStateFile(*osd));
  if (const Value* step = FindStep(*osd)) out.step = *step;
  out.states = std::move(states);
  notes->push_back("universal: " + std::to_string(opt.ParamNames().size()) + " parameters, states " +
                   Join(opt.states(), ", ") + (out.step ? ", step" : "") +
                   "; load it with --universal-checkpoint (checkpoint.load_universal)");
  return UniversalOutput(out);
}

Status CheckShards(const SourceOptimizer& opt) {
  if (opt.format().embedded || !opt.HasMasters()) {
    return Status::Unsupported("DeepSpeed loads universal checkpoints into ZeRO-1/2 and BF16 optimizers only; "
                               "this checkpoint keeps its optimizer state in the mp_rank files");
  }
  return Status::Ok();
}

}  // namespace

Status NoStateForUniversal(const std::string& what) {
  return Status::InvalidInput("a universal checkpoint is the optimizer state (fp32 masters and moments) by "
                              "parameter, and this checkpoint has no " + what +
                              "; export --to consolidated writes its weights");
}

Result<OutputPlan> PlanUniversal(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                                  const CheckpointFiles& files, ReplicatedPolicy replicated,
                                                  std::optional<int64_t> vocab_size, std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckShards(opt));
  std::vector<StateFile> states;
  for (const std::string& param : opt.ParamNames()) {
    for (const std::string& state : opt.states()) {
      RESHARD_ASSIGN_OR_RETURN(StateFile f, MakeStateFile(src, opt, replicated, vocab_size, param, state));
      states.push_back(std::move(f));
    }
  }
  return PlanStates(opt, files, std::move(states), notes);
}

Result<OutputPlan> PlanUniversalUnsplit(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                                         const CheckpointFiles& files,
                                                         std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckShards(opt));
  if (src.tp != 1) {
    return Status::Unsupported("a non-pipeline checkpoint at TP " + std::to_string(src.tp) +
                               " has no rules to merge its TP shards by; reshard writes universal checkpoints "
                               "of non-pipeline models at TP 1");
  }
  std::vector<std::vector<ParamShape>> groups;
  if (!ReadParamShapes(src.metadata[0], &groups)) {
    return Status::Unsupported(ModelStatesFileName(0) + " records no param_shapes, which give the universal "
                               "checkpoint's tensors their shapes");
  }
  std::vector<StateFile> states;
  for (const auto& group : groups) {
    for (const auto& [param, shape] : group) {
      for (const std::string& state : opt.states()) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, opt.Locate(param, 0, state));
        states.push_back(WholeState(param, state, shape, std::move(shard)));
      }
    }
  }
  return PlanStates(opt, files, std::move(states), notes);
}

Result<OutputPlan> PlanUniversalZero3(const Zero3Checkpoint& src, const CheckpointFiles& files,
                                                       std::vector<std::string>* notes) {
  if (src.mp() != 1) {
    return Status::Unsupported("this ZeRO-3 checkpoint has " + std::to_string(src.mp()) + " model-parallel ranks, "
                               "which have no rules to merge their shards by; reshard writes universal "
                               "checkpoints of ZeRO-3 models at TP 1");
  }
  UniversalFiles out;
  out.bare = true;
  for (const auto& [mp, by_dp] : files.zero3_model_files) {
    for (const auto& [dp, path] : by_dp) out.copies.emplace_back(Zero3ModelStatesFileName(dp, mp), path);
  }
  // DP rank 0's optimizer state, and its groups' hyperparameters beside it.
  const Value* osd = Find(src.ranks()[0].optimizer[0], "optimizer_state_dict");
  const Value* torch_sd = osd != nullptr ? Find(*osd, "optimizer_state_dict") : nullptr;
  const Value* groups = torch_sd != nullptr ? Find(*torch_sd, "param_groups") : nullptr;
  if (groups == nullptr) return Status::Internal("the ZeRO-3 optimizer state of DP rank 0 has no param_groups");
  out.optimizer_state = *osd;
  Set(out.optimizer_state, "param_groups", *groups);
  int64_t params = 0;
  for (const auto& group : src.ranks()[0].sub_groups) {
    for (const Zero3Param& p : group) {
      ++params;
      for (const std::string& state : src.states()) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, src.Locate(0, p.name, state));
        out.states.push_back(WholeState(p.name, state, {p.numel}, std::move(shard)));
      }
    }
  }
  notes->push_back("universal (DeepSpeed's ZeRO-3 form): " + std::to_string(params) + " parameters, states " +
                   Join(src.states(), ", ") + " as flat tensors; the step is in zero/optimizer_state.pt; load it "
                   "with --universal-checkpoint (checkpoint.load_universal)");
  return UniversalOutput(out);
}

}  // namespace reshard
