// An FSDP2 run's Distributed Checkpoint with its AdamW state, as torch 2.6
// saves one: what the torchtitan, DCP-recipe and Accelerate targets share
// (their keys are their own). It sits in formats/ itself, beside format.h,
// because several format folders share it and may not include each other.
//
// The ranks are a device mesh [dp_shard N, tp T], TP the fastest: rank
// d T + t. A tensor TP shards on dim D (-1: none) gives TP rank t the t-th
// of T equal shares of D; a TP replica is written once, by the TP rank 0 of
// each share. FSDP2 then shards the rows of each TP share again, Shard(0)
// over the N dp ranks: dp rank d holds rows [d c, (d + 1) c) of the share,
// c = ceil(rows / N), the last ranks fewer or none (torch.chunk, which
// DTensor's Shard uses); a rank with no rows writes no chunk. A 0-d tensor
// (a step) and a bytes item are written once, by rank 0, as torch's planner
// gives each replicated item to one rank.
//
// The AdamW state is torch 2.6's: the parameters are the fp32 masters,
// `exp_avg` and `exp_avg_sq` are chunked like their parameter, `step` is an
// fp32 0-d tensor per parameter, and each parameter's group holds AdamW's
// fields, and initial_lr where the source's has one (torch's LR schedulers
// add it) or the target asks for it always (a run that builds its scheduler
// before it loads, torchtitan, asks dcp.load for it: then the lr).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "container/dcp_writer.h"
#include "formats/format.h"
#include "formats/state_dict.h"

namespace reshard {

struct HfExport;  // formats/hf_common/hf_rules.h

// --dp-shard N: the FSDP2 world size, a layout option (convert keeps the
// source's DP size).
inline constexpr char kDpShardOption[] = "dp-shard";
FormatOptionInfo DpShardOption();

// The moments of torch's AdamW, in its order; the master is the parameter.
const std::vector<std::string>& AdamwMoments();

// The mesh [dp_shard, tp], TP the fastest (rank d * tp + t), as
// init_device_mesh numbers a 2-D mesh.
struct Fsdp2Mesh {
  int dp_shard = 1;
  int tp = 1;
  int ranks() const { return dp_shard * tp; }
};

// One tensor of the checkpoint, whole: its key, how its bytes are made, the
// dim TP shards (-1: replicated on the TP mesh), where it comes from (for
// --dry-run), and the keys torch nests it under (DcpWriteItem::path).
struct KeyedTensor {
  std::string key;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::function<ByteProducer(const std::vector<FullTensor>&)> bytes;
  int tp_dim = -1;
  std::string from;
  std::vector<Value> path;
};

// The checkpoint's items, one list per rank, and the files they make.
class Fsdp2Files {
 public:
  explicit Fsdp2Files(Fsdp2Mesh mesh) : mesh_(mesh), files_(mesh.ranks()) {}

  // `t` cut over the mesh, each rank's chunk in its file.
  void AddSharded(const KeyedTensor& t, const std::vector<FullTensor>& sources);
  // An item only rank 0 writes (a step, a hyperparameter).
  void AddToRankZero(DcpWriteItem item) { files_[0].push_back(std::move(item)); }
  // The step `step` under `key`, an fp32 0-d tensor, on rank 0.
  void AddStep(const std::string& key, float step, std::vector<Value> path = {});

  // Adds to `out` folder/__<rank>_0.distcp of every rank holding items, then
  // folder/.metadata ("" for the output's top). Consumes the items.
  Status AddTo(const std::string& folder, OutputPlan* out);

 private:
  std::optional<Box> BoxOf(const KeyedTensor& t, int d, int tp_rank) const;
  ByteProducer BoxBytes(const KeyedTensor& t, const ByteProducer& bytes, const Box& box, int tp_rank) const;

  const Fsdp2Mesh mesh_;
  std::vector<std::vector<DcpWriteItem>> files_;
};

// What both FSDP2 targets read of a source before they key its tensors:
// the family's HF names, every tensor whole, whether the optimizer state is
// written (the source has some and --weights-only does not leave it out),
// and the parameters chosen.
struct Fsdp2Source {
  const HfExport* hf = nullptr;
  std::vector<FullTensor> all;
  bool optimizer = false;
  std::vector<ChosenTensor> params;
};
// Reads them for target `to`, giving `out` its scratch folder and counting
// the bytes read in out->read; refuses naming every value the source lacks.
Result<Fsdp2Source> ReadFsdp2Source(const SourceCheckpoint& src, const RuleInputs& inputs,
                                    const ExportOptions& options, const std::string& to, OutputPlan* out,
                                    std::vector<std::string>* notes);

// Moment `moment` of every parameter of `params`, shaped and named like it;
// a state other than AdamW's is refused naming `to`.
Result<std::vector<ChosenTensor>> AdamwMoment(const std::vector<FullTensor>& all,
                                              const std::vector<ChosenTensor>& params, const std::string& moment,
                                              const std::string& to);

// The optimizer step as torch 2.6 keeps it per parameter (0 when the
// source records none).
Result<float> AdamwStep(const OptimizerParamGroups& groups);

// AdamW's fields of the group holding canonical parameter `param`, torch's
// defaults where the source records none (`defaulted` learns their names),
// and initial_lr where the source records it, or with `initial_lr_always`
// the lr where it does not; lists become tuples, as torch keeps betas.
Result<Items> AdamwGroup(const OptimizerParamGroups& groups, const std::string& param, bool initial_lr_always,
                         std::vector<std::string>* defaulted);

// Says which fields `defaulted` (AdamwGroup's) the target `to` wrote by default.
void NoteAdamwDefaults(const std::string& to, const std::vector<std::string>& defaulted,
                       std::vector<std::string>* notes);

// The tensors `chosen` under their HF names (hf_tensors.h's MapHfTensors),
// the scratch they need counted in `out`.
Result<std::vector<StateDictTensor>> Fsdp2HfTensors(const HfExport& hf, const std::vector<ChosenTensor>& chosen,
                                                    const RuleInputs& inputs, OutputPlan* out);

// A top-level key of a state dict in the checkpoint: its keys' beginning
// ("app.model.", "" for the top level) and the keys torch nests its items
// under ("app", "model").
struct StateDictPrefix {
  std::string dotted;
  std::vector<Value> path;

  // The prefix of the keys `words` ("app", "model"); none: the top level.
  static StateDictPrefix Of(const std::vector<std::string>& words);
  // The path of an item `rest` below the prefix.
  std::vector<Value> Path(std::vector<Value> rest) const;
};

// A model's state dict under its HF names and torch's AdamW state dict of
// it, as get_state_dict gives them for an FSDP2 run, each item cut over the
// ranks of the files it goes to: the model's under `model`
// (`MODEL.<fqn>`), the optimizer's under `optim`
// (`OPTIM.state.<fqn>.{exp_avg, exp_avg_sq, step}`, and the param groups
// indexed, `OPTIM.param_groups.<i>.<field>` with the group's FQNs in
// `.params`, the source's groups with the same hyperparameters made one;
// or flat, `OPTIM.param_groups.<fqn>.<field>`). The model's and the
// optimizer's files may be one checkpoint (torch's recipe) or two (Accelerate).
// Keyed by index (KeyByIndex), the optimizer's state dict is its own
// state_dict()'s instead: `OPTIM.state.<i>.*`, and the given param groups,
// `OPTIM.param_groups.<g>.params` their indices, `.param_names` their FQNs.
class Fsdp2StateDictWriter {
 public:
  Fsdp2StateDictWriter(StateDictPrefix model, StateDictPrefix optim, bool flat_groups, Fsdp2Files* model_files,
                       Fsdp2Files* optim_files)
      : model_(std::move(model)), optim_(std::move(optim)), flat_(flat_groups), model_files_(model_files),
        optim_files_(optim_files) {}

  // Keys the optimizer's state by parameter index, as an optimizer's own
  // state_dict() does (Accelerate's FSDP2 saves): `groups` are its param
  // groups, each its parameters' FQNs, numbered in the groups' order.
  void KeyByIndex(std::vector<std::vector<std::string>> groups);

  // The model's tensors of `read`, a tied head also under its own name (the
  // module's state dict holds both); returns how many.
  Result<int> AddModel(const Fsdp2Source& read, const RuleInputs& inputs, OutputPlan* out);
  // The AdamW state of every parameter of `read` (a tied copy has none: it
  // is no parameter of its own), refusals naming target `to`.
  Status AddOptimizer(const SourceCheckpoint& src, const Fsdp2Source& read, const RuleInputs& inputs,
                      const std::string& to, OutputPlan* out, std::vector<std::string>* notes);

 private:
  Status AddGroups(const std::vector<std::pair<std::string, Items>>& fields_of);
  Status AddIndexedGroups(const std::vector<std::pair<std::string, Items>>& fields_of);
  std::string StateKey(const std::string& fqn, const std::string& state) const;
  std::string StateName(const std::string& fqn) const;
  std::vector<Value> StatePath(const std::string& fqn, const std::string& state) const;
  void AddObject(const std::string& key, const Value& value, std::vector<Value> path);

  const StateDictPrefix model_;
  const StateDictPrefix optim_;
  const bool flat_;
  Fsdp2Files* const model_files_;
  Fsdp2Files* const optim_files_;
  std::vector<std::vector<std::string>> index_groups_;  // KeyByIndex's; empty: keyed by FQN
  std::map<std::string, int64_t> index_;                // FQN -> its index
};

}  // namespace reshard
