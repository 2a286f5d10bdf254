// MoeLayout: how a DeepSpeed MoE save spreads its experts, read from the
// files and the metadata and cross-checked.
//
//   which blocks are MoE       the blocks with tensors of `moe` rules
//   experts per MoE layer      mp_rank's `num_experts`, the expert files, the
//                              expert ids the `expert` rules read from the keys
//   EP size                    the expp_rank files, and the MoE optimizer
//                              groups' partition_count (= DP / EP)
//   expert-TP                  args.enable_expert_tensor_parallelism (or --set)
//
// Any disagreement is one InvalidInput line naming both sides.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formats/deepspeed/files/checkpoint_files.h"
#include "logical/logical_checkpoint.h"

namespace reshard {

// The expert file a tensor came from: layer_{moe_layer}_expert_{expert}
// (moe_layer -1: the old form expert_{expert}).
struct ExpertFileSlot {
  int moe_layer = 0;
  int expert = 0;
  int mp = 0;
};
// (layer id, key in the layer) -> the expert file of TP rank 0 it came from.
using ExpertOrigins = std::map<std::pair<int, std::string>, ExpertFileSlot>;

// One MoE layer.
struct MoeBlock {
  int stage = 0;     // pipeline stage
  int index = 0;     // the running MoE index within the stage (the m of layer_{m}_expert_*)
  int layer_id = 0;  // its layer (spec id)
  int block = 0;     // 0-based transformer block
  int experts = 0;   // global experts
};

struct MoeLayout {
  int ep = 1;   // expert-parallel size
  int edp = 1;  // expert-data-parallel size: DP / EP
  std::vector<MoeBlock> blocks;  // in layer order
  int expert_interval = 0;  // block i is MoE iff (i + 1) % interval == 0; 0: no such interval
  bool old_file_form = false;  // expert_{e}_mp_rank_* files
  std::vector<std::vector<int64_t>> experts_per_stage;  // num_experts of each stage
  std::optional<bool> expert_tp;  // --enable-expert-tensor-parallelism, when known

  // "EP 2 x expert-DP 2; 2 MoE layers of 4 experts (blocks 1, 3; every 2nd block)"
  std::string Summary() const;
  // The lines of `inspect`.
  std::string Describe() const;
};

// What the files and the metadata say, before the tensors are described:
// num_experts of every stage, the expert files it implies (either form),
// EP from the expp_rank files against the experts and the MoE optimizer
// groups' partition counts (the first optimizer shard of each mp rank is
// read). `ckpt` has its metadata, tp, pp and dp.
Result<MoeLayout> CheckMoeFiles(const CheckpointFiles& files, const LogicalCheckpoint& ckpt,
                                const std::set<std::string>& allowed_classes);

// Completes `layout` from the tensors the rules described: the MoE blocks
// (layers on the stages `stage_of_layer` names) against num_experts, each
// expert tensor against the file `origins` says it came from, the expert
// interval and expert-TP.
Status DescribeMoeBlocks(const LogicalCheckpoint& ckpt, const std::map<int, int>& stage_of_layer,
                         const ExpertOrigins& origins, MoeLayout* layout);

}  // namespace reshard
