// MoePlan: a DeepSpeed MoE checkpoint at another tensor-parallel, pipeline,
// expert-parallel and data-parallel size, as plain data (moe_writer.h writes
// it).
//
// At another TP each tensor is cut by its rule from every source TP rank's:
// the non-expert ones in the module, the experts in their files (whole on
// every TP rank, or split with expert-TP). Target stage p owns the layers
// (spec ids) [b[p], b[p+1]):
// DeepSpeed's partition of the target PP, or --layers-per-stage, or the
// source's own stages when PP is kept. Its mp_rank file's module holds those
// layers' non-expert tensors, drawn from every source stage that had them
// (written compact: DeepSpeed saves them as views into the optimizer's flat
// buffers), with dp_world_size, mp_world_size and num_experts rewritten; its
// expert files are the source's, renamed by the target stage's running MoE
// index (expert ids are global). The optimizer is re-cut per target stage:
// the source groups' kinds (hyperparameters) in DeepSpeed's order, each
// taking its members from every source stage that holds it; the non-expert
// groups over the target DP, and per target EP rank r the experts
// r * E/EP .. (r+1) * E/EP - 1 of every MoE layer, under their new local
// ids, partitioned over the target expert-DP (DP / EP). One expp_rank file
// per target EP rank; without ZeRO it holds that EP rank's torch state_dict
// (the same groups, unpartitioned, parameters indexed through them in
// order), or with BF16_Optimizer a copy of DP rank r's shard state. The
// module's `_metadata` lists the target stage's modules, with the target EP
// rank 0's expert modules.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "formats/deepspeed/moe/moe_layout.h"
#include "formats/deepspeed/moe/moe_optimizer.h"
#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/format.h"

namespace reshard {

// Where each tensor of a MoE reader's layers is: (layer, tensor) indices by
// the name it was saved under (MoeSaveName).
using TensorIndex = std::map<std::string, std::pair<int, int>>;
TensorIndex IndexTensors(const LogicalCheckpoint& src);

// The layers (ids) [lo, hi) of one target stage.
struct LayerRange {
  int lo = 0, hi = 0;
  bool Has(int id) const { return lo <= id && id < hi; }
};

// Expert `t` of `layer` in the order of an EP rank's expert groups (layer,
// expert, parameter): its name with local id `local`.
std::string ExpertName(const LogicalLayer& layer, const LogicalTensor& t, int local);

// The param group `group` of mp rank `mp`'s first shard (null: none).
const Value* ParamGroup(const MoeOptimizer& opt, int mp, int group);

// A tensor of a target stage's module: its key in the source mp rank `mp`'s
// module, and the logical tensor it is (src.layers[layer].tensors[tensor]).
struct MoeModuleEntry {
  int mp = 0;
  std::string key;
  int layer = 0, tensor = 0;
};

// An expert file of a target stage: the source file it copies.
struct MoeExpertFilePlan {
  std::string name;    // in the target folder
  std::string source;  // path of the source file
  int ep_rank = 0;     // the target EP rank whose expert it is
};

// Where a target optimizer group takes its hyperparameters and torch state
// template from: group `group` of mp rank `mp`'s shards.
struct MoeGroupSource {
  int mp = 0, group = 0;
};

struct MoeStagePlan {
  int mp = 0;         // the target mp rank
  int pp_rank = 0;    // its stage
  int tp_rank = 0;    // its TP rank
  int source_mp = 0;  // the mp rank whose metadata (counters, client state) and expp_rank file it copies
  std::vector<MoeBlock> blocks;  // its MoE layers; `stage` and `index` as the target numbers them
  // Its module's tensors, copied as saved when TP is kept, else cut from
  // every source TP rank's.
  std::vector<MoeModuleEntry> module_entries;
  std::vector<MoeExpertFilePlan> expert_files;
  std::vector<MoeGroupSource> group_sources;  // per optimizer group
  // Per target EP rank (empty: weights only).
  std::vector<OptimizerStagePlan> optimizer;
};

struct MoePlan {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int source_tp = 1, source_pp = 1, source_ep = 1;
  TensorTarget tensors;  // how each non-expert tensor is cut at the target TP
  std::vector<int> stage_bounds;  // target stage p owns the layers with ids [b[p], b[p+1])
  // Without ZeRO: each EP rank's torch state_dict goes into its expp_rank
  // file, and there are no shards.
  bool state_in_expp = false;
  // BF16_Optimizer without ZeRO: each EP rank's expp_rank file holds a copy
  // of its first shard's (DP rank r's) optimizer_state_dict.
  bool shard_copies_in_expp = false;
  std::vector<MoeStagePlan> stages;  // per mp rank
  std::vector<std::string> notes;
  // For the dry run: the target in one line; what a stage's mp_rank file
  // and an EP rank's expp_rank file hold; an EP rank's optimizer groups and
  // where each parameter's state comes from.
  std::string Summary() const;
  std::string StageWhat(const MoeStagePlan& stage) const;
  std::string ExppWhat(int ep_rank) const;
  std::vector<std::string> OptimizerDetail(const OptimizerStagePlan& o) const;
};

// What a MoE conversion targets.
struct MoeTarget {
  int ep = 1, dp = 1;
  std::vector<int> stage_bounds;  // see MoePlan
  ReplicatedPolicy replicated = ReplicatedPolicy::kCheck;
  int tp = 1;
  int64_t padded_vocab = 0;  // rows of the vocabulary tensors at `tp`
};

// The stage bounds of `src` as saved: stage p's mp_rank module starts at
// layer b[p]; the last bound is one past the last layer's id.
Result<std::vector<int>> SourceStageBounds(const LogicalCheckpoint& src);

// Plans `src` (read by the MoE reader: `layout`, `files`) at `target`;
// `opt` null: weights only.
Result<MoePlan> MakeMoePlan(const LogicalCheckpoint& src, const CheckpointFiles& files, const MoeLayout& layout,
                            const MoeOptimizer* opt, const MoeTarget& target);

}  // namespace reshard
