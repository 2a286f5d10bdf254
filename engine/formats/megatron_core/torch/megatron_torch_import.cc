#include "formats/megatron_core/torch/megatron_torch_import.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <functional>
#include <filesystem>
#include <map>
#include <optional>

#include "container/dcp_metadata.h"
#include "container/torch_file.h"
#include "formats/dcp_common/megatron_tracker.h"
#include "formats/megatron_core/common/megatron_args.h"
#include "formats/megatron_core/common/megatron_layout.h"
#include "formats/megatron_core/common/torch_dist_family.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "formats/megatron_core/torch/distrib_optim.h"
#include "logical/settings.h"
#include "logical/tp_placement.h"
#include "util/human.h"
#include "util/list_folder.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

constexpr char kRankFile[] = "model_optim_rng.pt";
constexpr char kExtraState[] = "._extra_state";
constexpr char kWeightsOnlyFix[] = "; pass --weights-only to convert the weights without it";

bool Exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

// "mp_rank_01_002": MegatronFileName's rank folder.
std::string RankFolderName(int tp_rank, int stage, int pp) {
  return fs::path(MegatronFileName(0, tp_rank, stage, pp)).parent_path().filename();
}

// A rank's tensors under one key: each TP rank's piece, in rank order.
struct StoredKey {
  int stage = 0, chunk = 0;           // the pipeline stage, and its model chunk
  std::string key;                    // as the files name it (the chunk's own layer index)
  std::vector<const Tensor*> ranks;   // by TP rank
};

// The rank files read, checked against each other, before any rule set.
struct RankFiles {
  std::string folder;
  int tp = 0, pp = 0;
  int vpp = 1;                     // the model chunks of each file: `model`, or `model0`, `model1`, ...
  std::vector<std::string> paths;  // stage by stage, TP rank by TP rank
  std::vector<Value> roots;        // the files' objects, in the same order
  std::vector<StoredKey> keys;     // stage by stage, chunk by chunk, in the first TP rank's order
  std::vector<std::vector<int>> chunk_layers;  // each stage's chunks' transformer layers
  int64_t extra_states = 0;
  bool optimizer = false;          // a file holds an `optimizer` entry
  bool distrib_optim = false;      // distrib_optim.pt files

  const std::string& Path(int tp_rank, int stage) const { return paths[stage * tp + tp_rank]; }
  std::string Name(int tp_rank, int stage) const { return RankFolderName(tp_rank, stage, pp); }
  const Value& Root(int tp_rank = 0, int stage = 0) const { return roots[stage * tp + tp_rank]; }
};

// The layout the rank folders give: TP and PP from the highest ranks.
Result<RankFiles> ScanRanks(const std::string& folder) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<fs::directory_entry> entries, ListFolder(folder));
  RankFiles files;
  files.folder = folder;
  std::optional<bool> staged;
  for (const fs::directory_entry& e : entries) {
    const std::optional<RankFolder> rank = ParseRankFolder(e.path().filename());
    if (!rank) continue;
    if (staged && *staged != rank->staged) {
      return Status::InvalidInput(folder + " holds mp_rank_TT folders and mp_rank_TT_PPP folders: they are the "
                                  "files of two checkpoints; keep one layout's");
    }
    staged = rank->staged;
    files.tp = std::max(files.tp, rank->tp_rank + 1);
    files.pp = std::max(files.pp, rank->pp_rank + 1);
    files.distrib_optim = files.distrib_optim || Exists(e.path() / kDistribOptimFile);
  }
  return files;
}

// The model chunks of a rank file: `model` alone, or Megatron-LM's
// `model0`, `model1`, ... of a virtual pipeline (0 for neither).
int ChunksOf(const Value& root) {
  if (Find(root, "model") != nullptr) return 1;
  int chunks = 0;
  while (Find(root, ModelChunkKey(chunks, 2)) != nullptr) ++chunks;
  return chunks;
}

// The TP and PP the args record, where they exceed what the folders show: a
// rank folder missing at the end is then named.
void WidenToArgs(RankFiles* files, const Value& root) {
  const Value* args = Find(root, "args");
  if (args == nullptr) return;
  files->tp = std::max<int>(files->tp, static_cast<int>(MetadataInt(*args, "tensor_model_parallel_size", 1)));
  files->pp = std::max<int>(files->pp, static_cast<int>(MetadataInt(*args, "pipeline_model_parallel_size", 1)));
}

// Every file holds the first's model chunks, each a dict, and no other.
Status CheckChunks(const Value& root, const std::string& path, int vpp) {
  const int chunks = ChunksOf(root);
  if (chunks == 0) {
    return Status::InvalidInput(path + " holds no `model` dict (nor a virtual pipeline's model0, model1, ...); it is "
                                "not a Megatron-LM checkpoint file");
  }
  if (chunks != vpp || Find(root, ModelChunkKey(vpp, 2)) != nullptr) {
    return Status::InvalidInput(path + " holds " + Count(chunks, "model chunk") + " where the first rank file holds " +
                                std::to_string(vpp) + "; every rank of a run holds as many: the file is of another "
                                "checkpoint, restore it from the saved checkpoint");
  }
  for (int c = 0; c < vpp; ++c) {
    if (DictItems(*Find(root, ModelChunkKey(c, vpp))) == nullptr) {
      return Status::InvalidInput(path + "'s " + ModelChunkKey(c, vpp) + " is not a dict; it is not a Megatron-LM "
                                  "checkpoint file");
    }
  }
  return Status::Ok();
}

Status ReadFiles(const CommonOptions& options, RankFiles* files) {
  PickleReadOptions read;
  read.inert_packages = MegatronPackages();  // plain data is read out of the args; nothing is written back
  read.allowed_globals = options.allowed_classes;
  for (int p = 0; p < files->pp; ++p) {
    for (int t = 0; t < files->tp; ++t) {
      const std::string rank = RankFolderName(t, p, files->pp);
      const std::string path = files->folder + "/" + rank + "/" + kRankFile;
      if (!Exists(path)) {
        return Status::InvalidInput(files->folder + " lacks " + rank + "/" + kRankFile + ": a Megatron-LM checkpoint at TP " + std::to_string(files->tp) +
                                    ", PP " + std::to_string(files->pp) + " has one file per rank; restore it "
                                    "from the saved checkpoint");
      }
      RESHARD_ASSIGN_OR_RETURN(Value root, ReadTorchFile(path, read));
      RESHARD_RETURN_IF_ERROR(CheckRunState(root, path));
      if (p == 0 && t == 0) {
        WidenToArgs(files, root);
        files->vpp = std::max(ChunksOf(root), 1);
      }
      RESHARD_RETURN_IF_ERROR(CheckChunks(root, path, files->vpp));
      files->optimizer = files->optimizer || Find(root, "optimizer") != nullptr;
      files->paths.push_back(path);
      files->roots.push_back(std::move(root));
    }
  }
  return Status::Ok();
}

// The tensors of `model` by flat key: Megatron-Core's keys as they are, the
// legacy model's nested dicts joined with dots.
void Flatten(const Value& model, const std::string& prefix, std::vector<std::pair<std::string, const Value*>>* out) {
  for (const auto& [k, v] : *DictItems(model)) {
    if (!k.is(Value::Kind::kString)) continue;
    const std::string key = prefix + k.as_string();
    if (DictItems(v) != nullptr) {
      Flatten(v, key + ".", out);
    } else {
      out->emplace_back(key, &v);
    }
  }
}

// The keys of model chunk `c` of stage `p`, each TP rank's piece beside the
// others; TP ranks must hold the same keys, their pieces of one shape and
// dtype.
Status CollectChunkKeys(int p, int c, RankFiles* files) {
  const std::string chunk = ModelChunkKey(c, files->vpp);
  const std::string shown = files->vpp == 1 ? "" : chunk + ".";  // how messages name a key
  std::map<std::string, size_t> index;  // key -> files->keys
  int layers = 0;
  for (int t = 0; t < files->tp; ++t) {
    std::vector<std::pair<std::string, const Value*>> flat;
    Flatten(*Find(files->Root(t, p), chunk), "", &flat);
    size_t held = 0;
    for (const auto& [key, v] : flat) {
      if (std::optional<std::pair<std::string, int>> layer = SplitLayerKey(key)) {
        layers = std::max(layers, layer->second + 1);
      }
      if (key != kExtraState && EndsWith(key, kExtraState)) {
        if (t == 0) files->extra_states++;
        continue;
      }
      if (!v->is(Value::Kind::kTensor)) {
        return Status::InvalidInput(files->Path(t, p) + "'s " + chunk + "." + key + " is " + v->DebugString(40) +
                                    ", not a tensor; it is not a Megatron-LM checkpoint file");
      }
      const Tensor& tensor = v->as_tensor();
      if (!tensor.IsContiguous()) {
        return Status::Unsupported(files->Path(t, p) + "'s " + chunk + "." + key + " is not contiguous in its storage; "
                                   "save it with .contiguous() tensors");
      }
      auto it = index.find(key);
      if (t == 0) {
        index.emplace(key, files->keys.size());
        files->keys.push_back({p, c, key, {&tensor}});
        continue;
      }
      if (it == index.end()) {
        return Status::InvalidInput(files->Name(t, p) + " holds " + shown + key + ", which " + files->Name(0, p) +
                                    " lacks; the TP ranks of a stage hold the same keys");
      }
      const Tensor& first = *files->keys[it->second].ranks[0];
      if (tensor.sizes != first.sizes || tensor.storage->dtype != first.storage->dtype) {
        return Status::InvalidInput(files->Name(t, p) + "'s " + shown + key + " is " + ShapeString(tensor.sizes) + " " +
                                    DTypeName(tensor.storage->dtype) + " where " + files->Name(0, p) + "'s is " +
                                    ShapeString(first.sizes) + " " + DTypeName(first.storage->dtype) +
                                    "; every TP rank holds an equal piece of it: the file is damaged or "
                                    "of another checkpoint");
      }
      files->keys[it->second].ranks.push_back(&tensor);
      ++held;
    }
    if (t > 0 && held != index.size()) {
      for (const auto& [key, at] : index) {
        if (files->keys[at].ranks.size() <= static_cast<size_t>(t)) {
          return Status::InvalidInput(files->Name(t, p) + " lacks " + shown + key + ", which " + files->Name(0, p) +
                                      " holds; the TP ranks of a stage hold the same keys");
        }
      }
    }
  }
  files->chunk_layers[p].push_back(layers);
  return Status::Ok();
}

// Every key of every stage's every model chunk.
Status CollectKeys(RankFiles* files) {
  for (int p = 0; p < files->pp; ++p) {
    files->chunk_layers.emplace_back();
    for (int c = 0; c < files->vpp; ++c) RESHARD_RETURN_IF_ERROR(CollectChunkKeys(p, c, files));
  }
  return Status::Ok();
}

Result<RankFiles> ReadRankFiles(const std::string& folder, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(RankFiles files, ScanRanks(folder));
  RESHARD_RETURN_IF_ERROR(ReadFiles(options, &files));
  RESHARD_RETURN_IF_ERROR(CollectKeys(&files));
  return files;
}

// Which of Megatron-Core's layer specs the keys are of, where a key tells.
enum class SpecSeen { kNone, kLocal, kTransformerEngine };

// Reads the rank files as the model of one rule set.
class FamilyReader {
 public:
  FamilyReader(const RankFiles& files, const RuleSet& rules, const CommonOptions& options)
      : f_(files),
        options_(options),
        family_(rules, RunMetadata(files), options, "megatron"),
        layout_(*rules.section<TorchDistLayout>()) {}

  Result<MegatronTorchImport> Read() {
    RESHARD_RETURN_IF_ERROR(family_.Start());
    RESHARD_RETURN_IF_ERROR(CheckTying());
    stages_ = PipelineStages(f_.chunk_layers);
    blocks_ = stages_.Total();
    RESHARD_RETURN_IF_ERROR(CheckStages());
    RESHARD_RETURN_IF_ERROR(MapKeys());
    RESHARD_RETURN_IF_ERROR(family_.RecordBlocks(blocks_, f_.folder));
    std::map<std::string, ImportedTensor> tensors;
    for (const auto& [name, stored] : mapped_) RESHARD_RETURN_IF_ERROR(JoinPieces(name, stored, &tensors));
    ReadOptimizer();
    RESHARD_RETURN_IF_ERROR(family_.Satisfy());
    auto keys_of = [this](const std::string& name) { return family_.KeysOf(name); };
    RESHARD_ASSIGN_OR_RETURN(LogicalCheckpoint logical, family_.Finish(tensors, keys_of, f_.folder));
    return Finish(std::move(logical));
  }

 private:
  static Value RunMetadata(const RankFiles& files) {
    const Value& root = files.Root();
    return ImportedRunMetadata(root, 0);
  }

  // Megatron-LM's args say whether the output layer is the word embedding
  // (the last stage's output_layer.weight is then its replica, not a head).
  Status CheckTying() const {
    const Value* untied = family_.inputs().Find("args.untie_embeddings_and_output_weights");
    if (untied == nullptr || !untied->is(Value::Kind::kBool) || untied->as_bool() != TiesEmbedding()) {
      return Status::Ok();
    }
    return family_.Refuse(std::string("its args ") + (untied->as_bool() ? "untie" : "tie") + " the output layer " +
                          "and the word embedding, which the rule set's model does not");
  }

  bool TiesEmbedding() const { return reshard::TiesEmbedding(family_.rules()); }

  // Each chunk's layers as the rank files hold them — the chunks numbered
  // in Megatron's interleaved order (PipelineStages) — which the args' stage
  // sizes and virtual pipeline size must give where the args record them;
  // recorded in the args where they record none, so that a conversion at
  // this PP keeps them.
  Status CheckStages() {
    const std::string shown = f_.folder + "'s rank files hold " + stages_.Describe();
    const Value& args = *Find(*family_.metadata(), "args");
    const bool recorded = std::any_of(std::begin(kPipelineSplitArgs), std::end(kPipelineSplitArgs),
                                      [&args](const char* field) { return Find(args, field) != nullptr; });
    PipelineSplit said = SplitOfArgs(args);
    if (!recorded) {
      Result<PipelineSplit> split = SplitOfCounts(stages_.counts());
      if (!split.ok()) return Status::InvalidInput(shown + ": " + split.status().message());
      said = *split;
    }
    const int vpp = VppOfArgs(args);
    if (vpp != f_.vpp && Find(args, kVppArg) != nullptr) {
      return Status::InvalidInput(shown + ", and its args' " + kVppArg + " is " + std::to_string(vpp) +
                                  ": the files are of another run; restore them from the saved checkpoint");
    }
    Result<PipelineStages> want = ChunkedStages(static_cast<int>(blocks_), f_.pp, f_.vpp, said, kSetSplitFlags);
    if (want.ok() && CountsOf(*want) == f_.chunk_layers) {
      if (!recorded) {
        if (said.first) SetPath(family_.metadata(), std::string("args.") + kPipelineSplitArgs[0], Value::Int(*said.first));
        if (said.last) SetPath(family_.metadata(), std::string("args.") + kPipelineSplitArgs[1], Value::Int(*said.last));
      }
      if (f_.vpp > 1) SetPath(family_.metadata(), std::string("args.") + kVppArg, Value::Int(f_.vpp));
      return Status::Ok();
    }
    if (!recorded) return Status::InvalidInput(shown + ", which no Megatron-Core run lays out: " + want.status().message());
    return Status::InvalidInput(shown + ", and its args' pipeline stage sizes (" + said.Describe() + ") " +
                                (want.ok() ? "give " + want->Describe() : "do not add up") +
                                ": the files are of another run; restore them from the saved checkpoint");
  }

  static std::vector<std::vector<int>> CountsOf(const PipelineStages& stages) {
    std::vector<std::vector<int>> counts(stages.pp());
    for (int p = 0; p < stages.pp(); ++p) {
      for (int c = 0; c < stages.vpp(); ++c) counts[p].push_back(stages.ChunkLayers(p, c));
    }
    return counts;
  }

  // Each stored key as the canonical tensor its torch_dist entry names.
  Status MapKeys() {
    for (const StoredKey& stored : f_.keys) {
      std::string key = stored.key;
      int64_t block = -1;
      if (std::optional<std::pair<std::string, int>> layer = SplitLayerKey(stored.key)) {
        key = layer->first;
        block = stages_.ChunkFirst(stored.stage, stored.chunk) + layer->second;
      }
      const TorchDistTensor* entry = family_.EntryOf(key);
      if (entry == nullptr && key == layout_.tied_head && IsLastChunk(stored)) {
        tied_copies_ += static_cast<int64_t>(stored.ranks.size());  // the last stage's replica of the tied embedding
        continue;
      }
      if (entry == nullptr || (entry->name.find("{block}") != std::string::npos) != (block >= 0)) {
        return family_.Refuse(f_.Name(0, stored.stage) + "/" + kRankFile + "'s " + Shown(stored) +
                              " is not a tensor of the model as its torch_dist section maps it");
      }
      NoteSpec(*entry, key);
      const std::string name = WithBlock(entry->name, block);
      if (!mapped_.emplace(name, Mapped{entry, &stored}).second) {
        return family_.Refuse(Shown(stored) + " and another key are both " + name);
      }
    }
    return Status::Ok();
  }

  bool IsLastChunk(const StoredKey& k) const { return k.stage == f_.pp - 1 && k.chunk == f_.vpp - 1; }

  // A stored key as messages name it: "model1.decoder.layers.0...." with a virtual pipeline.
  std::string Shown(const StoredKey& k) const {
    return f_.vpp == 1 ? k.key : ModelChunkKey(k.chunk, f_.vpp) + "." + k.key;
  }

  void NoteSpec(const TorchDistTensor& entry, const std::string& key) {
    if (entry.local_key.empty() || entry.keys.size() < 2) return;
    spec_ = key == entry.local_key ? SpecSeen::kLocal : SpecSeen::kTransformerEngine;
  }

  struct Mapped {
    const TorchDistTensor* entry;
    const StoredKey* stored;
  };

  // The canonical tensor `name` joined from its TP ranks' pieces, each where
  // the rule's TP cut puts that rank's piece.
  Status JoinPieces(const std::string& name, const Mapped& m, std::map<std::string, ImportedTensor>* tensors) {
    const StoredKey& s = *m.stored;
    const DType dtype = s.ranks[0]->storage->dtype;
    auto piece = [&s](int t) { return SourceShard::Of(*s.ranks[t], ShardCoords{t, s.stage, 0, 0}); };
    RESHARD_ASSIGN_OR_RETURN(SourceShard runs, JoinRanks(name, m, ElementSize(dtype), piece, true));
    auto unread = [name](int64_t, int64_t, uint8_t*) {
      return Status::Internal(name + " is read through its runs, not its placeholder tensor");
    };
    (*tensors)[name] = ImportedTensor{MakeProducedTensor(dtype, runs.shape, unread), std::move(runs)};
    return Status::Ok();
  }

  // The elements of canonical tensor `name` in row-major order, from its TP
  // ranks' pieces (`piece(t)`: rank t's elements), each placed where the
  // rule's TP cut puts it; `check` checks the shape against the section's.
  Result<SourceShard> JoinRanks(const std::string& name, const Mapped& m, int element_size,
                                const std::function<SourceShard(int)>& piece, bool check) {
    RESHARD_ASSIGN_OR_RETURN(const ParamRule* rule, family_.RuleOf(name, blocks_));
    const StoredKey& s = *m.stored;
    std::vector<int64_t> full = s.ranks[0]->sizes;
    if (rule->policy != ParamRule::Policy::kReplicated) {
      const bool vocab = rule->policy == ParamRule::Policy::kVocab;
      const size_t axis = vocab ? 0 : static_cast<size_t>(rule->dim);
      const int parts = vocab ? 1 : rule->parts;
      if (axis >= full.size() || full[axis] % parts != 0) {
        return Status::InvalidInput(f_.Name(0, s.stage) + "'s " + Shown(s) + " is " + ShapeString(full) + ", which "
                                    "rule set " + family_.rules().name() + "'s " + rule->Describe() + " (line " +
                                    std::to_string(rule->line) + ") cannot cut");
      }
      full[axis] *= f_.tp;
    }
    if (check) RESHARD_RETURN_IF_ERROR(family_.CheckShape(*m.entry, s.key, full));
    std::vector<SourceShard> pieces;
    // A replicated tensor is read from TP rank 0; its replicas are not compared.
    const int readers = rule->policy == ParamRule::Policy::kReplicated ? 1 : f_.tp;
    for (int t = 0; t < readers; ++t) {
      SourceShard p = piece(t);
      p.placements = PlaceTpRank(*rule, full, f_.tp, t).placements;
      pieces.push_back(std::move(p));
    }
    return JoinRuns(pieces, full, element_size, -1);
  }

  // ---- distrib_optim.pt ----------------------------------------------------

  // Each rank's flat pieces of each state, by stored key and TP rank.
  using StatePieces = std::map<std::pair<const StoredKey*, int>, std::array<SourceShard, 3>>;

  // The distributed optimizer's state: each rank's distrib_optim.pt cut by
  // the bucket layout of its parameters in registration order, each state of
  // a canonical tensor joined like its weight. A file that cannot be read
  // leaves the reason for the commands that need the state.
  void ReadOptimizer() {
    if (!f_.distrib_optim) return;
    Result<ImportedOptimizer> read = ReadDistribOptim();
    if (!read.ok()) {
      optimizer_status_ = read.status().WithContext("megatron");
      return;
    }
    family_.notes().push_back("megatron: " + read->what + ": fp32 masters, exp_avg and exp_avg_sq of " +
                              Count(static_cast<int64_t>(read->params.size()), "tensor") + ", " +
                              Count(static_cast<int64_t>(read->param_groups.size()), "param group") +
                              (read->step ? ", step " + read->step->DebugString(20) : std::string()));
    optimizer_ = std::move(*read);
  }

  Result<ImportedOptimizer> ReadDistribOptim() {
    if (layout_.optimizer_order.empty()) {
      return Status::Unsupported("the rule set's torch_dist section gives no optimizer_order, the registration order "
                                 "distrib_optim.pt's buffers follow; add one (docs/rules.md)" +
                                 std::string(kWeightsOnlyFix));
    }
    // The order given is the local spec's; Transformer Engine's layers
    // register the fused input norm after linear_proj.
    if (spec_ == SpecSeen::kTransformerEngine) {
      return Status::Unsupported("distrib_optim.pt of Transformer Engine layer-spec files: its buffers follow that "
                                 "spec's registration order, which the rule set does not give (its "
                                 "torch_dist.optimizer_order is the local spec's)" + std::string(kWeightsOnlyFix));
    }
    for (const auto& [name, m] : mapped_) {
      RESHARD_ASSIGN_OR_RETURN(const ParamRule* rule, family_.RuleOf(name, blocks_));
      if (rule->tied && rule->policy == ParamRule::Policy::kVocab) tied_embedding_ = m.stored;
    }
    StatePieces pieces;
    for (int p = 0; p < f_.pp; ++p) {
      for (int t = 0; t < f_.tp; ++t) RESHARD_RETURN_IF_ERROR(ReadRankState(t, p, &pieces));
    }
    ImportedOptimizer opt;
    opt.moments = {kTorchDistStates[1], kTorchDistStates[2]};
    for (const auto& [name, m] : mapped_) {
      ImportedOptimizer::Param& param = opt.params[name];
      for (int s = 0; s < 3; ++s) {
        auto piece = [&pieces, &m = m, s](int t) { return pieces.at({m.stored, t})[s]; };
        RESHARD_ASSIGN_OR_RETURN(SourceShard runs, JoinRanks(name, m, ElementSize(DType::kFloat32), piece, false));
        if (s == 0) {
          param.master = std::move(runs);
        } else {
          param.moments.push_back(std::move(runs));
        }
      }
    }
    RESHARD_RETURN_IF_ERROR(ReadParamGroups(&opt));
    opt.what = "Megatron-LM's distributed optimizer (distrib_optim.pt)";
    opt.layout = kDistribOptimFile;
    return opt;
  }

  // The stage's stored keys in registration order, model chunk by model
  // chunk, each with whether it is a tied embedding's pipeline copy (a
  // bucket of its own); every stored key must have a place.
  Result<std::vector<std::pair<const StoredKey*, bool>>> StageParams(int stage) const {
    std::map<std::pair<int, std::string>, const StoredKey*> stored;  // (chunk, key)
    for (const StoredKey& k : f_.keys) {
      if (k.stage == stage) stored[{k.chunk, k.key}] = &k;
    }
    const bool tied = f_.pp > 1 && tied_copies_ > 0;
    std::vector<std::pair<const StoredKey*, bool>> params;
    for (int chunk = 0; chunk < f_.vpp; ++chunk) {
      RESHARD_ASSIGN_OR_RETURN(std::vector<std::string> order,
                               ChunkKeysInRegistrationOrder(layout_, stage, chunk, stages_));
      for (const std::string& key : order) {
        auto it = stored.find({chunk, key});
        if (it == stored.end()) continue;
        const bool copy = tied && ((IsLastChunk(*it->second) && key == layout_.tied_head) ||
                                   it->second == tied_embedding_);
        params.emplace_back(it->second, copy);
        stored.erase(it);
      }
    }
    if (!stored.empty()) {
      return Status::Unsupported(f_.Name(0, stage) + "'s " + Shown(*stored.begin()->second) + " is not in the rule "
                                 "set's torch_dist.optimizer_order, the registration order distrib_optim.pt's "
                                 "buffers follow; add it (docs/rules.md)" + std::string(kWeightsOnlyFix));
    }
    return params;
  }

  Status ReadRankState(int t, int p, StatePieces* pieces) {
    const std::string path = f_.folder + "/" + f_.Name(t, p) + "/" + kDistribOptimFile;
    if (!Exists(path)) {
      return Status::InvalidInput(f_.folder + " lacks " + f_.Name(t, p) + "/" + kDistribOptimFile + ", which the "
                                  "other ranks have: restore it from the saved checkpoint" + kWeightsOnlyFix);
    }
    PickleReadOptions read;
    read.allowed_globals = options_.allowed_classes;
    RESHARD_ASSIGN_OR_RETURN(Value root, ReadTorchFile(path, read));
    RESHARD_ASSIGN_OR_RETURN(std::vector<GatheredBuffer> stored, ReadGatheredState(root, path, kWeightsOnlyFix));
    RESHARD_ASSIGN_OR_RETURN(auto params, StageParams(p));
    std::vector<GatheredParam> list;
    for (const auto& [k, copy] : params) {
      list.push_back({k->key, k->ranks[t]->storage->dtype, k->ranks[t]->numel(), copy, k->chunk});
    }
    RESHARD_ASSIGN_OR_RETURN(std::vector<GradBuffer> buffers, MegatronGradBuffers(list, BucketOptions{}));
    for (size_t b = 0; b < std::max(buffers.size(), stored.size()); ++b) {
      if (b >= buffers.size() || b >= stored.size() || buffers[b].param_dtype != stored[b].param_dtype ||
          buffers[b].numel_unpadded != stored[b].numel_unpadded) {
        return Status::InvalidInput(path + "'s grad buffers (" + BuffersText(stored) + ") are not those its rank's "
                                    "parameters in registration order lay out (" + BuffersText(buffers) + "): the "
                                    "file is damaged or of another checkpoint, or the rule set's optimizer_order "
                                    "does not describe the run" + kWeightsOnlyFix);
      }
      for (size_t j = 0; j < buffers[b].params.size(); ++j) {
        const StoredKey* key = params[buffers[b].params[j]].first;
        std::array<SourceShard, 3>& out = (*pieces)[{key, t}];
        for (int s = 0; s < 3; ++s) {
          const SourceShard flat = SourceShard::Of(*stored[b].states[s], ShardCoords{t, p, 0, 0});
          out[s].at = flat.at;
          out[s].shape = key->ranks[t]->sizes;
          out[s].runs = flat.RunsOf(buffers[b].offsets[j], buffers[b].layout.slots[j].numel, ElementSize(DType::kFloat32));
        }
      }
    }
    return Status::Ok();
  }

  template <typename Buffer>
  static std::string BuffersText(const std::vector<Buffer>& buffers) {
    std::vector<std::string> parts;
    for (const Buffer& b : buffers) parts.push_back(std::string(DTypeName(b.param_dtype)) + " " + std::to_string(b.numel_unpadded));
    return Join(parts, ", ");
  }

  // DistributedOptimizer.state_dict()'s param groups in model_optim_rng.pt's
  // `optimizer` entry, without `params`, decayed groups (wd_mult != 0) first;
  // the step of the first.
  Status ReadParamGroups(ImportedOptimizer* opt) const {
    const Value* entry = Find(f_.Root(), "optimizer");
    const Value* inner = entry != nullptr ? Find(*entry, "optimizer") : nullptr;
    const Value* groups = inner != nullptr ? Find(*inner, "param_groups") : nullptr;
    if (groups == nullptr || !groups->is(Value::Kind::kList) || groups->as_list().items.empty()) {
      return Status::InvalidInput(f_.paths[0] + " holds distrib_optim.pt's state but no optimizer.optimizer."
                                  "param_groups beside it; the checkpoint's optimizer state is incomplete" +
                                  std::string(kWeightsOnlyFix));
    }
    for (Value group : groups->as_list().items) {
      if (DictItems(group) == nullptr) return Status::InvalidInput(f_.paths[0] + "'s param_groups are not dicts");
      Items& items = *MutableDictItems(group);
      items.erase(std::remove_if(items.begin(), items.end(), [](const auto& kv) {
                    return kv.first.is(Value::Kind::kString) && kv.first.as_string() == "params";
                  }), items.end());
      opt->param_groups.push_back(std::move(group));
    }
    if (const Value* step = Find(opt->param_groups[0], "step")) opt->step = *step;
    std::stable_partition(opt->param_groups.begin(), opt->param_groups.end(), [](const Value& g) {
      const Value* wd_mult = Find(g, "wd_mult");
      return wd_mult == nullptr || !wd_mult->is(Value::Kind::kFloat) || wd_mult->as_float() != 0.0;
    });
    return Status::Ok();
  }

  std::string KeysName() const {
    switch (spec_) {
      case SpecSeen::kLocal: return "Megatron-Core keys, local layer spec";
      case SpecSeen::kTransformerEngine: return "Megatron-Core keys, Transformer Engine layer spec";
      case SpecSeen::kNone: break;
    }
    return "Megatron-Core keys";
  }

  Result<MegatronTorchImport> Finish(LogicalCheckpoint logical) {
    std::vector<std::string>& notes = family_.notes();
    if (f_.tp > 1) notes.push_back("megatron: replicated tensors (norms) are read from TP rank 0");
    if (tied_copies_ > 0) {
      notes.push_back("megatron: the last stage's " + layout_.tied_head + " is the tied word embedding's replica "
                      "(" + Count(tied_copies_, "TP piece") + "); it is dropped, the first stage's embedding is read");
    }
    if (f_.extra_states > 0) {
      notes.push_back("megatron: _extra_state (" + Count(f_.extra_states, "item") + " in each TP rank's files) is not carried: "
                      "reshard does not carry Transformer Engine's state yet");
    }
    if (!optimizer_status_.ok()) {
      notes.push_back(optimizer_status_.message());  // "megatron: <why it is not read>; <fix>"
    } else if (f_.optimizer && !f_.distrib_optim) {
      notes.push_back("megatron: weights only: the optimizer state of a run without --use-distributed-optimizer "
                      "(in model_optim_rng.pt) is not read; convert writes the weights without it");
    }
    MegatronTorchImport out;
    out.logical = std::move(logical);
    out.logical.vocab.padded_for_tp = f_.tp;  // the rank files' padding, made for their TP
    out.files = f_.paths;
    const int64_t iteration = out.logical.iteration;
    out.what = "Megatron-LM torch checkpoint (" + KeysName() + "): TP " + std::to_string(f_.tp) + ", PP " +
               std::to_string(f_.pp) + VppText() + (iteration > 0 ? "; iteration " + std::to_string(iteration) : std::string()) +
               " (" + Count(static_cast<int64_t>(f_.paths.size()), "rank file") + ")";
    out.notes = std::move(notes);
    out.facts = Facts(out);
    out.tp = f_.tp;
    out.pp = f_.pp;
    out.dp = static_cast<int>(DpOfArgs());
    out.optimizer = std::move(optimizer_);
    out.optimizer_status = optimizer_status_;
    return out;
  }

  // ", VPP 2 (model0, model1)" for a virtual pipeline's files, else "".
  std::string VppText() const {
    if (f_.vpp == 1) return "";
    return ", VPP " + std::to_string(f_.vpp) + " (" + ModelChunkKey(0, f_.vpp) + " .. " +
           ModelChunkKey(f_.vpp - 1, f_.vpp) + ")";
  }

  // The data-parallel size the args record (0: none).
  int64_t DpOfArgs() const {
    const Value* args = Find(f_.Root(), "args");
    return args != nullptr ? MetadataInt(*args, "data_parallel_size", 0) : 0;
  }

  // What the rank files record, in Megatron-LM's terms: the TP and PP of
  // their folders, the DP of their args.
  RecordedFacts Facts(const MegatronTorchImport& out) const {
    RecordedFacts facts;
    facts.emplace_back("keys", KeysName());
    const int64_t dp = DpOfArgs();
    facts.emplace_back("saved at", "TP " + std::to_string(f_.tp) + ", PP " + std::to_string(f_.pp) + VppText() + ", DP " +
                                       (dp > 0 ? std::to_string(dp) : "not recorded"));
    facts.emplace_back("iteration", std::to_string(out.logical.iteration));
    std::string optimizer = "none read";
    if (optimizer_) {
      optimizer = optimizer_->what + (optimizer_->step ? ", step " + optimizer_->step->DebugString(20) : "");
    } else if (!optimizer_status_.ok()) {
      optimizer = "not read (" + optimizer_status_.message() + ")";
    }
    facts.emplace_back("optimizer state", optimizer);
    facts.emplace_back("files", Count(static_cast<int64_t>(f_.paths.size()), "rank file"));
    return facts;
  }

  const RankFiles& f_;
  const CommonOptions& options_;
  TorchDistFamily family_;
  const TorchDistLayout& layout_;
  PipelineStages stages_;
  int64_t blocks_ = 0;
  std::map<std::string, Mapped> mapped_;
  int64_t tied_copies_ = 0;
  const StoredKey* tied_embedding_ = nullptr;  // the first stage's word embedding, when tied
  SpecSeen spec_ = SpecSeen::kNone;
  std::optional<ImportedOptimizer> optimizer_;
  Status optimizer_status_;
};

}  // namespace

std::string MegatronTorchFolder(const std::string& path) {
  auto holds_ranks = [](const std::string& folder) {
    return Exists(fs::path(folder) / "mp_rank_00" / kRankFile) || Exists(fs::path(folder) / "mp_rank_00_000" / kRankFile);
  };
  if (holds_ranks(path)) return path;
  const Result<std::string> folder = MegatronTrackedFolder(path);  // OpenCheckpoint refuses a bad tracker
  return folder.ok() && !folder->empty() && holds_ranks(path + "/" + *folder) ? path + "/" + *folder : "";
}

Result<MegatronTorchImport> ReadMegatronTorchImport(const std::string& folder, const CommonOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(RankFiles files, ReadRankFiles(folder, options));
  RESHARD_ASSIGN_OR_RETURN(std::vector<RuleSet> candidates,
                           TorchDistCandidates(options.rules, "a Megatron-LM torch checkpoint's Megatron-Core keys"));
  std::vector<std::string> reasons;
  for (const RuleSet& rules : candidates) {
    Result<MegatronTorchImport> imported = FamilyReader(files, rules, options).Read();
    if (imported.ok() || !options.rules.empty()) return imported;
    reasons.push_back(imported.status().message());
  }
  return Status::Unsupported("no built-in rule set reads the Megatron-LM torch checkpoint " + folder + " (" +
                             Join(reasons, "; ") + "); write a rule file with a torch_dist section (docs/rules.md) "
                             "and pass --rules FILE");
}

}  // namespace reshard
