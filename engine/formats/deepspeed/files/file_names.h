// DeepSpeed's checkpoint file names, parsed and printed in one place (as
// LevelDB's filename.h): every name reshard reads or writes in a tag folder.
//
//   layer_{LL}-model_{TT}-model_states.pt              weights of one pipeline spec, one TP rank
//   mp_rank_{MM}_model_states.pt                       metadata of one (pipeline, tensor) rank
//   [bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt  optimizer shard of one DP rank
//   zero_pp_rank_{D}_mp_rank_{MM}_model_states.pt      ZeRO-3 model states of one DP rank
//   layer_{M}_expert_{E}_mp_rank_{MM}_model_states.pt  MoE: expert E (global id) of MoE layer M
//   expert_{E}_mp_rank_{MM}_model_states.pt            MoE, old form: expert E of every MoE layer
//   expp_rank_{X}_mp_rank_{MM}_optim_states.pt         MoE: optimizer state of EP rank X
//
// Two-digit fields are zero-padded to at least two digits; DP ranks are not
// padded (nor are M, E and X). Parsing reads integers, never sorts strings, so 100+ ranks work.
#pragma once

#include <string>

namespace reshard {

struct DeepSpeedFileName {
  enum class Kind {
    kLayer, kModelStates, kOptimizer, kZero3ModelStates, kExpert, kExpertOptimizer, kOther
  };
  Kind kind = Kind::kOther;
  int layer = 0;  // kLayer: the spec id; kExpert: the MoE layer within the stage (-1: old form)
  int tp = 0;     // kLayer: the TP rank
  int mp = 0;     // every kind but kLayer: the (pipeline, tensor) rank
  int dp = 0;     // kOptimizer, kZero3ModelStates
  int expert = 0;  // kExpert: the global expert id
  int ep = 0;      // kExpertOptimizer: the expert-parallel rank
  bool bf16 = false;  // kOptimizer: the bf16_ prefix
};

// Scripts DeepSpeed copies beside `latest` in the checkpoint root at every
// save; they belong with a converted checkpoint's root too.
inline constexpr const char* kRootScripts[] = {"zero_to_fp32.py"};

// The pointer files whose presence makes a folder a checkpoint root of the
// DeepSpeed family (Megatron-DeepSpeed writes the iteration file beside
// `latest`; ds_to_universal writes `latest_universal`).
inline constexpr const char* kRootPointers[] = {"latest", "latest_checkpointed_iteration.txt", "latest_universal"};

// What the base name `name` is; kOther for names DeepSpeed does not write.
DeepSpeedFileName ParseDeepSpeedFileName(const std::string& name);

std::string LayerName(int layer_id);                    // "layer_04"
std::string LayerFileName(int layer_id, int tp_rank);   // "layer_04-model_01-model_states.pt"
std::string ModelStatesName(int mp_rank);               // "mp_rank_02"
std::string ModelStatesFileName(int mp_rank);           // "mp_rank_02_model_states.pt"
// "bf16_zero_pp_rank_3_mp_rank_01_optim_states.pt"
std::string OptimizerFileName(bool bf16_prefix, int dp_rank, int mp_rank);
// "zero_pp_rank_3_mp_rank_01_model_states.pt"
std::string Zero3ModelStatesFileName(int dp_rank, int mp_rank);
// "layer_1_expert_3_mp_rank_00_model_states.pt"; moe_layer -1: the old form
// "expert_3_mp_rank_00_model_states.pt".
std::string ExpertFileName(int moe_layer, int expert, int mp_rank);
// "expp_rank_1_mp_rank_00_optim_states.pt"
std::string ExpertOptimizerFileName(int ep_rank, int mp_rank);

// The name DeepSpeed writes for the rank file `f` parses as (kind and
// numbers; an optimizer shard's without its bf16_ prefix), "" for kOther.
// Two files of a tag folder with one RankFileName hold the same rank:
// "mp_rank_000_model_states.pt" and "mp_rank_00_model_states.pt" do.
std::string RankFileName(const DeepSpeedFileName& f);

// "mp_rank_00_model_states.pt" for ".../global_step20/mp_rank_00_model_states.pt".
std::string BaseName(const std::string& path);

}  // namespace reshard
