#include "formats/megatron/torch_dist_export.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "container/dcp_writer.h"
#include "formats/megatron/megatron_args.h"
#include "formats/megatron/megatron_layout.h"
#include "formats/state_dict.h"
#include "logical/logical_checkpoint.h"
#include "logical/tp_placement.h"
#include "util/human.h"
#include "util/shape.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kMetadataJson[] = "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1}";
// How Megatron-Core names the item of a sharded object: shard `i` of `n`.
constexpr char kCommonState[] = "common_state/shard_0_1";
// A job's share of a big .distcp file.
constexpr int64_t kPartBytes = int64_t{256} << 20;

std::string IterationFolder(int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

// The global shape of a rank tensor's canonical tensor over `tp` ranks.
std::vector<int64_t> GlobalShape(const RankTensor& r, int tp) {
  std::vector<int64_t> shape = r.shape;
  if (r.rule->policy != ParamRule::Policy::kReplicated) shape[r.rule->dim] *= tp;
  return shape;
}

// One box of a rank tensor in the canonical tensor, and where its bytes
// start in the rank tensor's.
struct RankBox {
  DcpChunk chunk;
  int64_t byte_offset = 0;
};

// TP rank `t`'s boxes (logical/tp_placement.h): one, or one per
// sub-parameter (`parts`) of a split along dim 0, each contiguous in the
// rank tensor.
Result<std::vector<RankBox>> RankBoxes(const RankTensor& r, int t, int tp, DType dtype) {
  const TpPlacement place = PlaceTpRank(*r.rule, GlobalShape(r, tp), tp, t);
  if (place.placements.size() > 1 && r.rule->dim != 0) {
    return Status::Unsupported("export --to torch_dist: " + r.name + " stacks " + std::to_string(r.rule->parts) +
                               " sub-parameters along dim " + std::to_string(r.rule->dim) + ", whose pieces are "
                               "not contiguous in a rank's tensor; only dim 0 is supported");
  }
  const int64_t rows = r.shape.empty() ? 0 : r.shape[0];
  const int64_t row_bytes = rows == 0 ? 0 : ShapeNumel(r.shape) / rows * ElementSize(dtype);
  std::vector<RankBox> boxes;
  for (const Placement& p : place.placements) {
    boxes.push_back({DcpChunk{p.global.offsets, p.global.sizes}, p.local.empty() ? 0 : p.local[0] * row_bytes});
  }
  return boxes;
}

// Bytes [begin, begin + length) of `from`.
ByteProducer Window(ByteProducer from, int64_t begin) {
  return [from = std::move(from), begin](int64_t offset, int64_t length, uint8_t* dst) {
    return from(begin + offset, length, dst);
  };
}

struct Target {
  TpCut cut;
  int pp = 1;
  int blocks = 0, blocks_per_stage = 0;
  std::optional<DType> dtype;
};

int StageOf(const RankTensor& r, const Target& target) {
  if (r.block >= 0) return r.block / target.blocks_per_stage;
  return r.rule->role == "embedding" ? 0 : target.pp - 1;
}

// The items of TP rank `t`'s tensors, by stage.
Status AddRankItems(const RuleSet& rules, const std::vector<RankTensor>& tensors, int t, const Target& target,
                    std::vector<std::vector<DcpWriteItem>>* by_stage) {
  for (const RankTensor& r : tensors) {
    if (t > 0 && r.rule->policy == ParamRule::Policy::kReplicated) continue;  // TP rank 0 writes it
    RESHARD_ASSIGN_OR_RETURN(const TorchDistTensor* entry, TorchDistEntryOf(rules, r, "torch_dist"));
    const std::string& key = entry->keys.front();  // what current Megatron-Core names it
    const bool stacked = r.block >= 0;
    const DType dtype = target.dtype && IsFloatingPoint(r.dtype) ? *target.dtype : r.dtype;
    RESHARD_ASSIGN_OR_RETURN(std::vector<RankBox> boxes, RankBoxes(r, t, target.cut.tp, dtype));
    std::vector<int64_t> size = GlobalShape(r, target.cut.tp);
    if (stacked) size.insert(size.begin(), target.blocks);
    const ByteProducer bytes = dtype == r.dtype ? r.produce : CastBytes(r.produce, r.dtype, dtype);
    for (RankBox& box : boxes) {
      if (stacked) {
        box.chunk.offsets.insert(box.chunk.offsets.begin(), r.block);
        box.chunk.sizes.insert(box.chunk.sizes.begin(), 1);
      }
      (*by_stage)[StageOf(r, target)].push_back(
          DcpTensorItem(key, dtype, size, std::move(box.chunk), Window(bytes, box.byte_offset)));
    }
  }
  return Status::Ok();
}

// Each linear layer's extra state, empty, as Megatron-Core wraps an object:
// [None], item `shard_{layer}_{layers}`.
void AddExtraStates(const RuleSet& rules, const Target& target, std::vector<std::vector<DcpWriteItem>>* by_stage) {
  for (const std::string& module : rules.torch_dist()->extra_state) {
    for (int l = 0; l < target.blocks; ++l) {
      const std::string fqn = module + "._extra_state/shard_" + std::to_string(l) + "_" + std::to_string(target.blocks);
      (*by_stage)[l / target.blocks_per_stage].push_back(DcpBytesItem(fqn, Value::MakeList({Value::None()})));
    }
  }
}

// Megatron-Core 0.19's common state: what Megatron-LM's load reads before
// the tensors.
Value CommonState(const SourceCheckpoint& src, const Target& target, int64_t padded_vocab,
                  std::vector<std::string>* notes) {
  Value state = Value::MakeDict();
  const Value* args = Find(src.info().metadata, "args");
  if (args != nullptr && DictItems(*args) != nullptr) {
    Value written = MegatronArgs(*args, {target.cut.tp, target.pp, 1, padded_vocab}, notes);
    // The true vocabulary size, as Megatron-LM's --vocab-size records it: what
    // re-padding for another TP needs.
    const std::optional<int64_t> vocab = target.cut.vocab_size ? target.cut.vocab_size : src.info().vocab_size;
    if (vocab) Set(written, "vocab_size", Value::Int(*vocab));
    Set(state, "args", std::move(written));
  }
  Set(state, "checkpoint_version", Value::Float(3.0));
  Set(state, "iteration", Value::Int(src.info().iteration));
  return Value::MakeList({std::move(state)});
}

Status CheckSource(const SourceCheckpoint& src, const ExportOptions& options) {
  const std::shared_ptr<const RuleSet>& rules = src.info().rules;
  if (rules == nullptr || rules->torch_dist() == nullptr) {
    return Status::Unsupported("export --to torch_dist writes the keys a rule set's torch_dist section names, and " +
                               (rules == nullptr ? "this " + src.info().kind + " checkpoint is read without a rule set"
                                                 : "rule set " + rules->name() + " has none") +
                               "; export --to consolidated writes its tensors");
  }
  if (options.tp < 1 || options.pp < 1) {
    return Status::InvalidInput("export --to torch_dist needs the target layout: --tp N and --pp N (both >= 1)");
  }
  if (!options.from.empty() && options.from != "weights" && options.from != "masters") {
    return Status::InvalidInput("unknown --from '" + options.from + "'; use weights or masters");
  }
  return Status::Ok();
}

int CountBlocks(const std::vector<RankTensor>& tensors) {
  int blocks = 0;
  for (const RankTensor& t : tensors) blocks = std::max(blocks, t.block + 1);
  return blocks;
}

}  // namespace

Result<OutputPlan> PlanTorchDist(const SourceCheckpoint& src, const ExportOptions& options,
                                 std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckSource(src, options));
  const RuleSet& rules = *src.info().rules;
  Target target;
  target.cut = TpCut{options.tp, options.replicated, options.vocab_size, options.from == "masters"};
  target.pp = options.pp;
  RESHARD_ASSIGN_OR_RETURN(target.dtype, ExportDType(options.dtype));
  OutputPlan out;
  RESHARD_ASSIGN_OR_RETURN(TpWeights weights, src.WeightsForTp(target.cut, notes, out.read.get()));
  target.blocks = CountBlocks(weights.ranks[0]);
  RESHARD_ASSIGN_OR_RETURN(target.blocks_per_stage, BlocksPerStage(target.blocks, target.pp));

  std::vector<std::vector<std::vector<DcpWriteItem>>> items(
      options.tp, std::vector<std::vector<DcpWriteItem>>(target.pp));  // [TP rank][stage]
  for (int t = 0; t < options.tp; ++t) {
    RESHARD_RETURN_IF_ERROR(AddRankItems(rules, weights.ranks[t], t, target, &items[t]));
  }
  AddExtraStates(rules, target, &items[0]);
  items[0][0].push_back(DcpBytesItem(kCommonState, CommonState(src, target, weights.padded_vocab, notes)));

  const std::string folder = IterationFolder(src.info().iteration);
  for (int p = 0; p < target.pp; ++p) {
    for (int t = 0; t < options.tp; ++t) {
      const int rank = p * options.tp + t;
      RESHARD_ASSIGN_OR_RETURN(DcpFileLayout layout,
                               LayOutDcpFile("__" + std::to_string(rank) + "_0.distcp", std::move(items[t][p])));
      out.files.push_back(DcpDataFile(folder, "stage " + std::to_string(p) + ", TP rank " + std::to_string(t),
                                      std::move(layout), kPartBytes));
    }
  }
  std::vector<const PlannedFile*> data;
  for (const PlannedFile& f : out.files) data.push_back(&f);
  RESHARD_ASSIGN_OR_RETURN(PlannedFile metadata, DcpMetadataFile(folder, data));
  out.files.push_back(std::move(metadata));
  out.files.push_back(TextFile(folder + "/metadata.json", kMetadataJson));
  out.files.push_back(TextFile(kLatestIterationFile, std::to_string(src.info().iteration)));
  out.summary = "torch_dist: TP " + std::to_string(options.tp) + ", PP " + std::to_string(target.pp) +
                ", iteration " + std::to_string(src.info().iteration) + "; " +
                Count(target.blocks, "block") + ", stacked; padded vocabulary " +
                std::to_string(weights.padded_vocab) + "\n";
  notes->push_back("torch_dist: weights only, no optimizer or RNG state; load with --no-load-optim --no-load-rng "
                   "(or --finetune, which also restarts the iteration count)");
  return out;
}

}  // namespace reshard
