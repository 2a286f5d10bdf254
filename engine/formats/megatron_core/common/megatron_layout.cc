#include "formats/megatron_core/common/megatron_layout.h"

#include <re2/re2.h>

#include <cstdio>

#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";
constexpr char kLayers[] = "decoder.layers.";
constexpr char kEmbedding[] = "embedding.";

// "word_embeddings.norm.weight" -> {"word_embeddings", "norm.weight"}: the
// module under the spec and the key in that module's state dict.
Result<std::pair<std::string, std::string>> SplitModule(const std::string& role, const std::string& key) {
  const size_t dot = key.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == key.size()) {
    return Status::Unsupported("the " + role + " tensor '" + key + "' names no module of Megatron-LM's " + role +
                               " (expected <module>.<parameter>)");
  }
  return std::make_pair(key.substr(0, dot), key.substr(dot + 1));
}

}  // namespace

std::string MegatronFileName(int64_t iteration, int tp_rank, int pp_rank, int pp) {
  char name[96];
  if (pp == 1) {
    std::snprintf(name, sizeof(name), "iter_%07lld/mp_rank_%02d/model_optim_rng.pt",
                  static_cast<long long>(iteration), tp_rank);
  } else {
    std::snprintf(name, sizeof(name), "iter_%07lld/mp_rank_%02d_%03d/model_optim_rng.pt",
                  static_cast<long long>(iteration), tp_rank, pp_rank);
  }
  return name;
}

std::optional<RankFolder> ParseRankFolder(const std::string& name) {
  static const RE2 folder("mp_rank_([0-9]{2})(?:_([0-9]{3}))?");
  std::string tp, pp;
  RankFolder out;
  if (!RE2::FullMatch(name, folder, &tp, &pp)) return std::nullopt;
  out.staged = !pp.empty();
  int64_t t = 0, p = 0;
  ParseInt(tp, &t);
  if (out.staged) ParseInt(pp, &p);
  out.tp_rank = static_cast<int>(t);
  out.pp_rank = static_cast<int>(p);
  return out;
}

Result<int> BlocksPerStage(int blocks, int pp) {
  if (pp < 1 || blocks < pp || blocks % pp != 0) {
    return Status::InvalidInput("Megatron-LM gives every pipeline stage the same number of transformer blocks, "
                                "and " + Count(blocks, "block") + (blocks == 1 ? " does" : " do") + " not divide into " +
                                Count(pp, "stage") + "; choose a --pp that divides " +
                                std::to_string(blocks));
  }
  return blocks / pp;
}

Result<ModelPlace> PlaceOf(const std::string& role, const std::string& key, int block, int per_stage, int pp) {
  if (role == "embedding") {
    // Embedding.state_dict_for_save_checkpoint: each module's own state dict.
    RESHARD_ASSIGN_OR_RETURN(auto module, SplitModule(role, key));
    return ModelPlace{0, {"language_model", "embedding", module.first, module.second}};
  }
  if (role == "block") {
    const int stage = block / per_stage;
    return ModelPlace{stage, {"language_model", "encoder",
                              "layers." + std::to_string(block - stage * per_stage) + "." + key}};
  }
  if (role == "final_norm") return ModelPlace{pp - 1, {"language_model", "encoder", "final_layernorm." + key}};
  if (role == "head") {
    // The untied head's module (LMHeadPipe.lm_head) is Megatron-LM's output_layer.
    RESHARD_ASSIGN_OR_RETURN(auto module, SplitModule(role, key));
    return ModelPlace{pp - 1, {"language_model", "output_layer", module.second}};
  }
  return Status::Unsupported("the rule set's '" + role + "' layers have no place in Megatron-LM's GPT model "
                             "(embedding, blocks, final norm, output layer)");
}

ModelPlace HeadEmbeddingPlace(int pp) { return ModelPlace{pp - 1, {"word_embeddings_for_head", "weight"}}; }

Result<const TorchDistTensor*> TorchDistEntryOf(const RuleSet& rules, const RankTensor& r, const std::string& target) {
  for (const TorchDistTensor& entry : rules.torch_dist()->tensors) {
    std::string name = entry.name;
    const size_t at = name.find(kBlock);
    if ((at != std::string::npos) != (r.block >= 0)) continue;
    if (at != std::string::npos) name.replace(at, sizeof(kBlock) - 1, std::to_string(r.block));
    if (name == r.name) return &entry;
  }
  return Status::Unsupported("export --to " + target + ": rule set " + rules.name() + "'s torch_dist section gives "
                             "no key for " + r.name + "; add an entry for it (docs/rules.md)");
}

bool IsTiedVocab(const RankTensor& t) {
  return t.rule->tied && t.rule->policy == ParamRule::Policy::kVocab && t.rule->role == "embedding";
}

DType WrittenDType(const RankTensor& t, const std::optional<DType>& dtype) {
  return dtype && IsFloatingPoint(t.dtype) ? *dtype : t.dtype;
}

bool IsLayerKey(const std::string& key) { return key.compare(0, sizeof(kLayers) - 1, kLayers) == 0; }

Result<std::string> LayerKey(const std::string& stacked, int local_block) {
  if (!IsLayerKey(stacked)) {
    return Status::Unsupported("the torch_dist key '" + stacked + "' of a block tensor is not under " + kLayers +
                               ", where Megatron-Core's GPTModel keeps its layers; fix the rule file's key");
  }
  const size_t prefix = sizeof(kLayers) - 1;
  return stacked.substr(0, prefix) + std::to_string(local_block) + "." + stacked.substr(prefix);
}

std::optional<std::pair<std::string, int>> SplitLayerKey(const std::string& key) {
  static const RE2 layer("decoder\\.layers\\.([0-9]+)\\.(.+)");
  std::string index, rest;
  int64_t local = 0;
  if (!RE2::FullMatch(key, layer, &index, &rest) || !ParseInt(index, &local)) return std::nullopt;
  return std::make_pair(std::string(kLayers) + rest, static_cast<int>(local));
}

int StageOfModule(const std::string& key, int pp) {
  return key.compare(0, sizeof(kEmbedding) - 1, kEmbedding) == 0 ? 0 : pp - 1;
}

}  // namespace reshard
