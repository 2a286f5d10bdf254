#include "formats/deepspeed/files/file_names.h"

#include <re2/re2.h>

#include <cstdio>

namespace reshard {
namespace {

const RE2& LayerFileRegex() {
  static const RE2 re(R"(layer_(\d+)-model_(\d+)-model_states\.pt)");
  return re;
}
const RE2& MpRankRegex() {
  static const RE2 re(R"(mp_rank_(\d+)_model_states\.pt)");
  return re;
}
const RE2& Zero3ModelRegex() {
  static const RE2 re(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return re;
}
const RE2& OptimizerRegex() {
  static const RE2 re(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  return re;
}

const RE2& ExpertRegex() {
  static const RE2 re(R"(layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return re;
}
const RE2& OldExpertRegex() {
  static const RE2 re(R"(expert_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return re;
}
const RE2& ExpertOptimizerRegex() {
  static const RE2 re(R"(expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  return re;
}

std::string TwoDigits(int v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%02d", v);
  return buf;
}

}  // namespace

DeepSpeedFileName ParseDeepSpeedFileName(const std::string& name) {
  using Kind = DeepSpeedFileName::Kind;
  DeepSpeedFileName f;
  std::string bf16;
  if (RE2::FullMatch(name, LayerFileRegex(), &f.layer, &f.tp)) {
    f.kind = Kind::kLayer;
  } else if (RE2::FullMatch(name, MpRankRegex(), &f.mp)) {
    f.kind = Kind::kModelStates;
  } else if (RE2::FullMatch(name, OptimizerRegex(), &bf16, &f.dp, &f.mp)) {
    f.kind = Kind::kOptimizer;
    f.bf16 = !bf16.empty();
  } else if (RE2::FullMatch(name, Zero3ModelRegex(), &f.dp, &f.mp)) {
    f.kind = Kind::kZero3ModelStates;
  } else if (RE2::FullMatch(name, ExpertRegex(), &f.layer, &f.expert, &f.mp)) {
    f.kind = Kind::kExpert;
  } else if (RE2::FullMatch(name, OldExpertRegex(), &f.expert, &f.mp)) {
    f.kind = Kind::kExpert;
    f.layer = -1;
  } else if (RE2::FullMatch(name, ExpertOptimizerRegex(), &f.ep, &f.mp)) {
    f.kind = Kind::kExpertOptimizer;
  }
  return f;
}

std::string LayerName(int layer_id) { return "layer_" + TwoDigits(layer_id); }
std::string LayerFileName(int layer_id, int tp_rank) {
  return LayerName(layer_id) + "-model_" + TwoDigits(tp_rank) + "-model_states.pt";
}
std::string ModelStatesName(int mp_rank) { return "mp_rank_" + TwoDigits(mp_rank); }
std::string ModelStatesFileName(int mp_rank) { return ModelStatesName(mp_rank) + "_model_states.pt"; }

std::string OptimizerFileName(bool bf16_prefix, int dp_rank, int mp_rank) {
  return std::string(bf16_prefix ? "bf16_" : "") + "zero_pp_rank_" + std::to_string(dp_rank) +
         "_" + ModelStatesName(mp_rank) + "_optim_states.pt";
}

std::string Zero3ModelStatesFileName(int dp_rank, int mp_rank) {
  return "zero_pp_rank_" + std::to_string(dp_rank) + "_" + ModelStatesName(mp_rank) +
         "_model_states.pt";
}

std::string ExpertFileName(int moe_layer, int expert, int mp_rank) {
  const std::string layer = moe_layer < 0 ? "" : "layer_" + std::to_string(moe_layer) + "_";
  return layer + "expert_" + std::to_string(expert) + "_" + ModelStatesFileName(mp_rank);
}

std::string ExpertOptimizerFileName(int ep_rank, int mp_rank) {
  return "expp_rank_" + std::to_string(ep_rank) + "_" + ModelStatesName(mp_rank) + "_optim_states.pt";
}

std::string RankFileName(const DeepSpeedFileName& f) {
  using Kind = DeepSpeedFileName::Kind;
  switch (f.kind) {
    case Kind::kLayer: return LayerFileName(f.layer, f.tp);
    case Kind::kModelStates: return ModelStatesFileName(f.mp);
    case Kind::kOptimizer: return OptimizerFileName(false, f.dp, f.mp);
    case Kind::kZero3ModelStates: return Zero3ModelStatesFileName(f.dp, f.mp);
    case Kind::kExpert: return ExpertFileName(f.layer, f.expert, f.mp);
    case Kind::kExpertOptimizer: return ExpertOptimizerFileName(f.ep, f.mp);
    case Kind::kOther: break;
  }
  return "";
}

std::string BaseName(const std::string& path) { return path.substr(path.rfind('/') + 1); }

}  // namespace reshard
