#include "formats/deepspeed/moe/moe_layout.h"

#include <algorithm>

#include "formats/deepspeed/files/file_names.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "util/strings.h"

namespace reshard {
namespace {

std::string Ints(const std::vector<int64_t>& v) {
  std::vector<std::string> s;
  for (int64_t x : v) s.push_back(std::to_string(x));
  return "[" + Join(s, ", ") + "]";
}

int BlockOf(const LogicalCheckpoint& ckpt, int id) {
  int block = 0;
  for (int i = 0; i < id; ++i) block += ckpt.specs[i].role == "block" ? 1 : 0;
  return block;
}

bool HasMoeTensor(const LogicalLayer& layer) {
  return std::any_of(layer.tensors.begin(), layer.tensors.end(),
                     [](const LogicalTensor& t) { return t.rule->MoeOnly(); });
}

// The global expert ids the layer's expert tensors carry.
std::set<int> ExpertIds(const LogicalLayer& layer) {
  std::set<int> ids;
  for (const LogicalTensor& t : layer.tensors) {
    if (t.rule->expert > 0) ids.insert(t.rule->ExpertId(t.key));
  }
  return ids;
}

// The stage of each layer: the mp_rank file whose `module` or expert files
// held it. Layers are in id order and stages are contiguous, so a stage's
// MoE layers are numbered in id order.
std::vector<MoeBlock> FindMoeBlocks(const LogicalCheckpoint& ckpt, const std::map<int, int>& stage_of_layer) {
  std::vector<MoeBlock> blocks;
  std::map<int, int> next_index;  // per stage
  for (const LogicalLayer& layer : ckpt.layers) {
    if (!HasMoeTensor(layer)) continue;
    MoeBlock b;
    b.layer_id = layer.id;
    b.stage = stage_of_layer.at(layer.id);
    b.index = next_index[b.stage]++;
    b.block = BlockOf(ckpt, layer.id);
    b.experts = static_cast<int>(ExpertIds(layer).size());
    blocks.push_back(b);
  }
  return blocks;
}

// num_experts of each stage's mp_rank file, one count per MoE layer.
Result<std::vector<std::vector<int64_t>>> RecordedExperts(const LogicalCheckpoint& ckpt) {
  std::vector<std::vector<int64_t>> out;
  for (int p = 0; p < ckpt.pp; ++p) {
    const int mp = p * ckpt.tp;
    std::vector<int64_t> recorded;
    const Value* v = Find(ckpt.metadata[mp], "num_experts");
    if (v == nullptr || !ReadIntSequence(*v, &recorded)) {
      return Status::InvalidInput(ModelStatesFileName(mp) + " has no num_experts list, but the folder holds "
                                  "expert files; it is not a DeepSpeed MoE save, or the file is damaged");
    }
    out.push_back(std::move(recorded));
  }
  return out;
}

// The MoE blocks the rules find are the ones num_experts records.
Status CheckNumExperts(const MoeLayout& layout) {
  for (size_t p = 0; p < layout.experts_per_stage.size(); ++p) {
    std::vector<int64_t> have;
    for (const MoeBlock& b : layout.blocks) {
      if (b.stage == static_cast<int>(p)) have.push_back(b.experts);
    }
    if (layout.experts_per_stage[p] != have) {
      return Status::InvalidInput("num_experts of stage " + std::to_string(p) + " is " +
                                  Ints(layout.experts_per_stage[p]) + " but its tensors show " + Ints(have) +
                                  " (experts per MoE layer); the folder is incomplete or mixes checkpoints");
    }
  }
  return Status::Ok();
}

// Every mp rank has one expert file per MoE layer of its stage and global
// expert num_experts records, in one of the two forms (the old one holds an
// expert of every MoE layer, so they all have as many experts).
Status CheckExpertFiles(const CheckpointFiles& files, const LogicalCheckpoint& ckpt, const MoeLayout& layout) {
  for (int mp = 0; mp < ckpt.tp * ckpt.pp; ++mp) {
    const std::vector<int64_t>& experts = layout.experts_per_stage[mp / ckpt.tp];
    std::set<std::pair<int, int>> want, have;
    for (size_t m = 0; m < experts.size(); ++m) {
      for (int e = 0; e < experts[m]; ++e) want.insert({layout.old_file_form ? -1 : static_cast<int>(m), e});
    }
    auto it = files.expert_files.find(mp);
    if (it != files.expert_files.end()) {
      for (const auto& [m, by_expert] : it->second) {
        for (const auto& [e, path] : by_expert) have.insert({m, e});
      }
    }
    for (const auto& slot : want) {
      if (!have.count(slot)) {
        return Status::InvalidInput(ExpertFileName(slot.first, slot.second, mp) + " is missing (" +
                                    ModelStatesFileName(mp) + " records num_experts " + Ints(experts) +
                                    "); the checkpoint is incomplete");
      }
    }
    for (const auto& slot : have) {
      if (!want.count(slot)) {
        return Status::InvalidInput(files.tag_dir + " holds " + ExpertFileName(slot.first, slot.second, mp) +
                                    ", an expert num_experts " + Ints(experts) + " of " + ModelStatesFileName(mp) +
                                    " does not have; remove it if it does not belong to this checkpoint");
      }
    }
  }
  return Status::Ok();
}

// Each expert tensor came from the file of its MoE layer and global expert,
// and expert files hold only expert tensors.
Status CheckOrigins(const LogicalCheckpoint& ckpt, const std::vector<MoeBlock>& blocks,
                    const ExpertOrigins& origins, bool old_form) {
  std::map<int, int> index_of_layer;
  for (const MoeBlock& b : blocks) index_of_layer[b.layer_id] = b.index;
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      auto it = origins.find({layer.id, t.key});
      if (t.rule->expert == 0) {
        if (it == origins.end()) continue;
        const ExpertFileSlot& slot = it->second;
        return Status::InvalidInput(
            ExpertFileName(slot.moe_layer, slot.expert, slot.mp) + " holds " + t.label + ", which the rules (" + ckpt.rules->origin() + ") do not mark as an expert tensor; "
            "give its rule `expert: N` (the capture group of the expert id) or fix the key pattern");
      }
      if (it == origins.end()) {
        return Status::InvalidInput(t.label + " is an expert tensor by its rule but is not in an expert "
                                    "file; the checkpoint was not saved by DeepSpeed's MoE path");
      }
      const int id = t.rule->ExpertId(t.key);
      const int m = old_form ? -1 : index_of_layer.at(layer.id);
      if (it->second.expert != id || it->second.moe_layer != m) {
        const ExpertFileSlot& slot = it->second;
        return Status::InvalidInput(ExpertFileName(slot.moe_layer, slot.expert, slot.mp) + " holds " + t.label + ", expert " + std::to_string(id) +
                                    " of MoE layer " + std::to_string(m) +
                                    "; the file is misnamed or the checkpoint mixes saves");
      }
    }
  }
  return Status::Ok();
}

// partition_count of the MoE groups in mp rank `mp`'s first shard (empty
// when there is no shard); DeepSpeed marks those groups `moe: True`.
Result<std::vector<int64_t>> MoePartitionCounts(const CheckpointFiles& files, int mp,
                                                const std::set<std::string>& allowed) {
  std::vector<int64_t> counts;
  const OptimizerShardFile* first = nullptr;
  for (const OptimizerShardFile& f : files.optimizer_files) {
    if (f.mp_rank == mp && (first == nullptr || f.dp_rank < first->dp_rank)) first = &f;
  }
  if (first == nullptr) return counts;
  RESHARD_ASSIGN_OR_RETURN(Value root, ReadDeepSpeedFile(first->path, allowed));
  const Value* osd = Find(root, "optimizer_state_dict");
  const Value* pc = osd ? Find(*osd, "partition_count") : nullptr;
  const Value* base = osd ? Find(*osd, "base_optimizer_state") : nullptr;
  const Value* groups = base ? Find(*base, "param_groups") : nullptr;
  std::vector<int64_t> all;
  if (pc == nullptr || groups == nullptr || !groups->is(Value::Kind::kList) || !ReadIntSequence(*pc, &all) ||
      all.size() != groups->as_list().items.size()) {
    return Status::InvalidInput(BaseName(first->path) + " has no partition_count per parameter group; "
                                "it is not a ZeRO-1/2 or BF16 optimizer shard of DeepSpeed");
  }
  for (size_t g = 0; g < all.size(); ++g) {
    const Value* moe = Find(groups->as_list().items[g], "moe");
    if (moe != nullptr && moe->is(Value::Kind::kBool) && moe->as_bool()) counts.push_back(all[g]);
  }
  return counts;
}

// EP from the expp_rank files (ranks 0..EP-1 on every mp rank).
Result<int> EpFromFiles(const CheckpointFiles& files, int mp_ranks) {
  int ep = -1;
  for (int mp = 0; mp < mp_ranks; ++mp) {
    auto it = files.expert_optimizer_files.find(mp);
    const int n = it == files.expert_optimizer_files.end() ? 0 : static_cast<int>(it->second.size());
    const int top = n == 0 ? 0 : it->second.rbegin()->first + 1;
    if (n == 0 || top != n) {
      return Status::InvalidInput(
          (n == 0 ? "no expp_rank_*_" + ModelStatesName(mp) + "_optim_states.pt files"
                  : "expp_rank files of " + ModelStatesName(mp) + " skip EP ranks (" + std::to_string(n) +
                        " files up to EP rank " + std::to_string(top - 1) + ")") +
          "; DeepSpeed writes one per EP rank and mp rank, so the checkpoint is incomplete");
    }
    if (ep >= 0 && n < ep) {
      return Status::InvalidInput(ExpertOptimizerFileName(n, mp) + " is missing: " + ModelStatesName(0) + " has " +
                                  std::to_string(ep) + " expp_rank files and " + ModelStatesName(mp) + " " +
                                  std::to_string(n) + "; the checkpoint is incomplete");
    }
    if (ep >= 0 && n != ep) {
      return Status::InvalidInput(ModelStatesName(mp) + " has " + std::to_string(n) +
                                  " expp_rank files but mp_rank_00 has " + std::to_string(ep) +
                                  "; the folder mixes checkpoints");
    }
    ep = n;
  }
  return ep;
}

// Names the expp_rank files missing at the end: EP is inferred from the
// files, so a missing last EP rank shows only as MoE groups partitioned over
// fewer ranks than DP / EP. `counts` holds each mp rank's partition counts.
Status CheckLastEpRanks(const std::vector<std::vector<int64_t>>& counts, int dp, int ep) {
  for (size_t mp = 0; mp < counts.size(); ++mp) {
    for (int64_t c : counts[mp]) {
      if (c < 1 || dp % c != 0 || dp / c <= ep) continue;
      std::vector<std::string> missing;
      for (int e = ep; e < dp / c; ++e) missing.push_back(ExpertOptimizerFileName(e, static_cast<int>(mp)));
      return Status::InvalidInput(Join(missing, ", ") + (missing.size() == 1 ? " is" : " are") + " missing: the "
                                  "MoE optimizer groups of " + ModelStatesName(static_cast<int>(mp)) +
                                  " are partitioned over " + std::to_string(c) + " ranks, so DP " +
                                  std::to_string(dp) + " has EP " + std::to_string(dp / c) + " and one expp_rank "
                                  "file per EP rank, and the folder holds " + std::to_string(ep) +
                                  "; the checkpoint is incomplete");
    }
  }
  return Status::Ok();
}

// EP and expert-DP, from the expp_rank files, checked against the expert
// counts and the MoE optimizer groups' partition counts.
Status FindExpertParallel(const CheckpointFiles& files, const LogicalCheckpoint& ckpt,
                          const std::set<std::string>& allowed, MoeLayout* layout) {
  RESHARD_ASSIGN_OR_RETURN(layout->ep, EpFromFiles(files, ckpt.tp * ckpt.pp));
  const int ep = layout->ep;
  std::vector<std::vector<int64_t>> counts;
  for (int mp = 0; mp < ckpt.tp * ckpt.pp; ++mp) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<int64_t> of_mp, MoePartitionCounts(files, mp, allowed));
    counts.push_back(std::move(of_mp));
  }
  RESHARD_RETURN_IF_ERROR(CheckLastEpRanks(counts, ckpt.dp, ep));
  if (ckpt.dp % ep != 0) {
    return Status::InvalidInput(std::to_string(ep) + " expp_rank files (EP " + std::to_string(ep) +
                                ") do not divide DP " + std::to_string(ckpt.dp) + "; the folder mixes checkpoints");
  }
  layout->edp = ckpt.dp / ep;
  for (size_t p = 0; p < layout->experts_per_stage.size(); ++p) {
    for (size_t m = 0; m < layout->experts_per_stage[p].size(); ++m) {
      const int64_t experts = layout->experts_per_stage[p][m];
      if (experts % ep == 0) continue;
      return Status::InvalidInput("MoE layer " + std::to_string(m) + " of stage " + std::to_string(p) + " has " +
                                  std::to_string(experts) + " experts (num_experts), which EP " + std::to_string(ep) +
                                  " (the expp_rank files) does not divide; the folder mixes checkpoints");
    }
  }
  for (int mp = 0; mp < ckpt.tp * ckpt.pp; ++mp) {
    for (int64_t c : counts[mp]) {
      if (c == layout->edp) continue;
      return Status::InvalidInput("the MoE optimizer groups of " + ModelStatesName(mp) + " are partitioned over " +
                                  std::to_string(c) + " ranks, but DP " + std::to_string(ckpt.dp) + " / EP " +
                                  std::to_string(ep) + " (the expp_rank files) is " + std::to_string(layout->edp) +
                                  "; the folder mixes checkpoints");
    }
  }
  return Status::Ok();
}

// The interval i such that block b is MoE iff (b + 1) % i == 0 (Megatron's
// --expert-interval); 0 when the MoE blocks follow no such rule.
int ExpertInterval(const LogicalCheckpoint& ckpt, const std::vector<MoeBlock>& blocks) {
  if (blocks.empty()) return 0;
  const int interval = blocks.front().block + 1;
  const int num_blocks = static_cast<int>(std::count_if(ckpt.specs.begin(), ckpt.specs.end(),
                                                        [](const SpecEntry& s) { return s.role == "block"; }));
  std::set<int> want, have;
  for (int b = 0; b < num_blocks; ++b) {
    if ((b + 1) % interval == 0) want.insert(b);
  }
  for (const MoeBlock& b : blocks) have.insert(b.block);
  return want == have ? interval : 0;
}

// With --enable-expert-tensor-parallelism the experts are TP-sliced like
// the dense MLP; without it they are whole on every TP rank. The rules must
// say the same.
Status CheckExpertTp(const LogicalCheckpoint& ckpt, std::optional<bool> expert_tp) {
  if (ckpt.tp == 1 || !expert_tp) return Status::Ok();
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) {
      if (t.rule->expert == 0 || (t.rule->policy == ParamRule::Policy::kReplicated) != *expert_tp) continue;
      return Status::InvalidInput(
          std::string("args.enable_expert_tensor_parallelism is ") + (*expert_tp ? "true" : "false") + " but " +
          ckpt.rules->origin() + ":" + std::to_string(t.rule->line) + " describes " + t.label + " as " +
          t.rule->Describe() + "; use rules whose expert tensors are " +
          (*expert_tp ? "split like the dense MLP's" : "replicated (whole on every TP rank)"));
    }
  }
  return Status::Ok();
}

bool OldForm(const CheckpointFiles& files) {
  for (const auto& [mp, by_layer] : files.expert_files) {
    if (by_layer.count(-1)) return true;
  }
  return false;
}

std::string Ordinal(int n) {
  if (n == 1) return "block";
  const char* suffix = (n % 10 == 1 && n % 100 != 11) ? "st" : (n % 10 == 2 && n % 100 != 12) ? "nd"
                     : (n % 10 == 3 && n % 100 != 13) ? "rd" : "th";
  return std::to_string(n) + suffix + " block";
}

}  // namespace

std::string MoeLayout::Summary() const {
  std::set<int> counts;
  std::vector<std::string> where;
  for (const MoeBlock& b : blocks) {
    counts.insert(b.experts);
    where.push_back(std::to_string(b.block));
  }
  std::vector<std::string> count_text;
  for (int c : counts) count_text.push_back(std::to_string(c));
  std::string s = "EP " + std::to_string(ep) + " x expert-DP " + std::to_string(edp) + "; " +
                  std::to_string(blocks.size()) + " MoE layers of " + Join(count_text, "/") + " experts (blocks " +
                  Join(where, ", ");
  s += expert_interval > 0 ? "; every " + Ordinal(expert_interval) + ")" : ")";
  return s;
}

std::string MoeLayout::Describe() const {
  std::string out = "MoE: " + Summary() + "\n";
  out += "  expert files: " + std::string(old_file_form ? "old form expert_{e}_mp_rank_*" : "layer_{m}_expert_{e}_mp_rank_*") +
         "; expert tensors " +
         (!expert_tp ? "whole on every TP rank unless --enable-expert-tensor-parallelism (not recorded; "
                       "give --set args.enable_expert_tensor_parallelism=true if it was on)"
                     : *expert_tp ? "TP-sliced (--enable-expert-tensor-parallelism)"
                                  : "whole on every TP rank") + "\n";
  for (const MoeBlock& b : blocks) {
    const int local = b.experts / ep;
    const std::string held = local == 1 ? "expert r" : "experts " + std::to_string(local) + "r.." +
                                                          std::to_string(local) + "r+" + std::to_string(local - 1);
    out += "  block " + std::to_string(b.block) + " (layer " + std::to_string(b.layer_id) + ", stage " +
           std::to_string(b.stage) + ", MoE layer " + std::to_string(b.index) + "): " + std::to_string(b.experts) +
           " experts, " + std::to_string(local) + " per EP rank (EP rank r holds " + held + ")\n";
  }
  return out;
}

Result<MoeLayout> CheckMoeFiles(const CheckpointFiles& files, const LogicalCheckpoint& ckpt,
                                const std::set<std::string>& allowed_classes) {
  MoeLayout layout;
  RESHARD_ASSIGN_OR_RETURN(layout.experts_per_stage, RecordedExperts(ckpt));
  layout.old_file_form = OldForm(files);
  RESHARD_RETURN_IF_ERROR(CheckExpertFiles(files, ckpt, layout));
  RESHARD_RETURN_IF_ERROR(FindExpertParallel(files, ckpt, allowed_classes, &layout));
  return layout;
}

Status DescribeMoeBlocks(const LogicalCheckpoint& ckpt, const std::map<int, int>& stage_of_layer,
                         const ExpertOrigins& origins, MoeLayout* layout) {
  layout->blocks = FindMoeBlocks(ckpt, stage_of_layer);
  if (layout->blocks.empty()) {
    return Status::InvalidInput("the folder holds expert files, but no tensor matches an `expert` or `moe` rule of "
                                "rule set '" + ckpt.rules->name() + "'; choose MoE rules with --rules (e.g. "
                                "megatron-gpt2-moe) or mark the expert tensors' rules with expert: N");
  }
  // Misnamed expert files first: they also make the blocks' keys disagree.
  RESHARD_RETURN_IF_ERROR(CheckOrigins(ckpt, layout->blocks, origins, layout->old_file_form));
  if (ckpt.HasErrors()) return Status::Ok();  // the findings say what is wrong with the tensors
  RESHARD_RETURN_IF_ERROR(CheckNumExperts(*layout));
  layout->expert_interval = ExpertInterval(ckpt, layout->blocks);
  if (const Value* v = ckpt.inputs().Find("args.enable_expert_tensor_parallelism")) {
    if (v->is(Value::Kind::kBool)) layout->expert_tp = v->as_bool();
  }
  return CheckExpertTp(ckpt, layout->expert_tp);
}

}  // namespace reshard
