#include "formats/megatron_core/common/megatron_layout.h"

#include <re2/re2.h>

#include <algorithm>
#include <cstdio>

#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kBlock[] = "{block}";
constexpr char kExpert[] = "{expert}";
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

const SplitFlags kExportSplitFlags{std::string("--") + kFirstStageOption + " N",
                                   std::string("--") + kLastStageOption + " N"};
const SplitFlags kSetSplitFlags{"--set decoder_first_pipeline_num_layers=N", "--set decoder_last_pipeline_num_layers=N"};

std::string PipelineSplit::Describe() const {
  std::vector<std::string> parts;
  if (first) parts.push_back("first stage " + std::to_string(*first));
  if (last) parts.push_back("last stage " + std::to_string(*last));
  if (embedding) parts.push_back("the embedding counted as a layer");
  if (loss) parts.push_back("the loss counted as a layer");
  return parts.empty() ? "even" : Join(parts, ", ");
}

PipelineSplit SplitOfArgs(const std::function<std::optional<int64_t>(const std::string& field)>& field) {
  PipelineSplit split;
  if (std::optional<int64_t> n = field(kPipelineSplitArgs[0])) split.first = static_cast<int>(*n);
  if (std::optional<int64_t> n = field(kPipelineSplitArgs[1])) split.last = static_cast<int>(*n);
  split.embedding = field(kPipelineSplitArgs[2]).value_or(0) != 0;
  split.loss = field(kPipelineSplitArgs[3]).value_or(0) != 0;
  return split;
}

PipelineSplit SplitOfArgs(const Value& args) {
  return SplitOfArgs([&args](const std::string& name) -> std::optional<int64_t> {
    const Value* v = Find(args, name);
    int64_t n = 0;
    if (v == nullptr || !ReadInt(*v, &n)) return std::nullopt;
    return n;
  });
}

namespace {

// The first / last stage's sizes given: the others share the rest evenly.
Result<std::vector<int>> UnevenCounts(int layers, int pp, const PipelineSplit& split, const SplitFlags& flags) {
  if (split.embedding || split.loss) {
    return Status::InvalidInput("Megatron-Core does not combine the first or last stage's layers (" + split.Describe() +
                                ") with counting the embedding or loss as a layer; give only the stage sizes");
  }
  if ((split.first && *split.first < 1) || (split.last && *split.last < 1)) {
    return Status::InvalidInput("a first or last pipeline stage holds at least one layer (" + split.Describe() +
                                "); give " + flags.first + " with N >= 1");
  }
  int rest = layers, middle = pp;
  for (const std::optional<int>& given : {split.first, split.last}) {
    if (!given) continue;
    rest -= *given;
    --middle;
  }
  if (middle < 0 || rest < 0 || (rest > 0) != (middle > 0) || (middle > 0 && rest % middle != 0)) {
    return Status::InvalidInput("the pipeline stage sizes (" + split.Describe() + ") leave " + Count(rest, "layer") +
                                " of " + std::to_string(layers) + " for " + Count(std::max(middle, 0), "other stage") +
                                ", which Megatron-Core cannot split evenly; give " + flags.first + " and " + flags.last +
                                " that leave each other stage as many layers");
  }
  std::vector<int> counts(pp, middle > 0 ? rest / middle : 0);
  if (split.first) counts.front() = *split.first;
  if (split.last) counts.back() = *split.last;
  return counts;
}

}  // namespace

Result<std::vector<int>> StageLayerCounts(int layers, int pp, const PipelineSplit& split, const SplitFlags& flags) {
  if (pp < 1) return Status::InvalidInput("--pp " + std::to_string(pp) + ": a size is at least 1");
  if (split.first || split.last) return UnevenCounts(layers, pp, split, flags);
  // The embedding and the loss each counted as one more layer of their stage.
  const int counted = layers + (split.embedding ? 1 : 0) + (split.loss ? 1 : 0);
  const int per_stage = counted / pp;
  if (counted % pp != 0 || (split.embedding && per_stage < 1) || (split.loss && per_stage < 1)) {
    return Status::InvalidInput("Megatron-Core splits the transformer layers evenly over the pipeline stages "
                                "unless given the first or last stage's, and " + Count(layers, "layer") +
                                (split.Even() ? "" : " (" + split.Describe() + ")") +
                                (counted == layers ? "" : std::string(" counted as ") + std::to_string(counted)) +
                                " do not divide into " + Count(pp, "stage") + "; give " + flags.first + " or " +
                                flags.last + ", or a --pp that divides " + std::to_string(counted));
  }
  std::vector<int> counts(pp, per_stage);
  if (split.embedding) counts.front() -= 1;
  if (split.loss) counts.back() -= 1;
  return counts;
}

Result<PipelineSplit> SplitOfCounts(const std::vector<int>& counts) {
  PipelineSplit split;
  const int pp = static_cast<int>(counts.size());
  if (pp < 2 || std::all_of(counts.begin(), counts.end(), [&counts](int n) { return n == counts[0]; })) return split;
  // At PP 2 the first stage's size says both.
  const int middle = counts[1];
  const bool equal_middle = std::all_of(counts.begin() + 1, counts.end() - 1, [middle](int n) { return n == middle; });
  if (pp == 2 || counts.front() != middle) split.first = counts.front();
  if (pp > 2 && counts.back() != middle) split.last = counts.back();
  int total = 0;
  for (int n : counts) total += n;
  Result<std::vector<int>> again = StageLayerCounts(total, pp, split, kExportSplitFlags);
  if (!equal_middle || !again.ok() || *again != counts) {
    std::vector<std::string> text;
    for (int n : counts) text.push_back(std::to_string(n));
    return Status::InvalidInput("pipeline stages of " + Join(text, ", ") + " layers, which no Megatron-Core run lays "
                                "out (the stages between the first and the last hold as many, at least one)");
  }
  return split;
}

PipelineStages::PipelineStages(std::vector<int> layers) : layers_(std::move(layers)) {
  int first = 0;
  for (int n : layers_) {
    first_.push_back(first);
    first += n;
  }
}

int PipelineStages::StageOf(int block) const {
  int stage = 0;
  while (stage + 1 < pp() && block >= first_[stage + 1]) ++stage;
  return stage;
}

std::string PipelineStages::Describe() const {
  if (std::all_of(layers_.begin(), layers_.end(), [this](int n) { return n == layers_[0]; })) {
    return Count(layers_.empty() ? 0 : layers_[0], "block") + " per stage";
  }
  std::vector<std::string> text;
  for (int n : layers_) text.push_back(std::to_string(n));
  return "blocks per stage " + Join(text, ", ");
}

std::vector<FormatOptionInfo> PipelineSplitOptions() {
  using Kind = FormatOptionInfo::Kind;
  return {{kFirstStageOption, Kind::kCount,
           "Megatron-LM's --decoder-first-pipeline-num-layers: the first pipeline stage's transformer layers, the "
           "stages without a size given sharing the rest evenly (default: the source's own split at its own PP, "
           "else even)"},
          {kLastStageOption, Kind::kCount,
           "Megatron-LM's --decoder-last-pipeline-num-layers: the last pipeline stage's transformer layers (default: "
           "the source's own split at its own PP, else even)"}};
}

Result<TargetPipeline> ChooseTargetPipeline(const SourceCheckpoint& src, const ExportOptions& options, int layers,
                                            int pp, std::vector<std::string>* notes) {
  TargetPipeline out;
  const int64_t first = FormatCount(options, kFirstStageOption), last = FormatCount(options, kLastStageOption);
  if (first > 0) out.split.first = static_cast<int>(first);
  if (last > 0) out.split.last = static_cast<int>(last);
  const Value* args = Find(src.info().metadata, "args");
  if (out.split.Even() && args != nullptr && DictItems(*args) != nullptr) {
    const PipelineSplit own = SplitOfArgs(*args);
    if (!own.Even() && src.info().pp == pp) {
      out.split = own;
    } else if (!own.Even()) {
      notes->push_back("the source's pipeline stage sizes (" + own.Describe() + ") are its PP " +
                       std::to_string(src.info().pp) + "'s; the PP " + std::to_string(pp) + " written splits the "
                       "layers evenly (" + kExportSplitFlags.first + " or " + kExportSplitFlags.last +
                       " choose other sizes)");
    }
  }
  RESHARD_ASSIGN_OR_RETURN(std::vector<int> counts, StageLayerCounts(layers, pp, out.split, kExportSplitFlags));
  out.stages = PipelineStages(std::move(counts));
  return out;
}

std::string PipelineLoadNote(const std::string& target, const TargetPipeline& pipeline) {
  const PipelineSplit& split = pipeline.split;
  if (split.Even()) return "";
  std::vector<std::string> flags;
  if (split.first) flags.push_back("--decoder-first-pipeline-num-layers " + std::to_string(*split.first));
  if (split.last) flags.push_back("--decoder-last-pipeline-num-layers " + std::to_string(*split.last));
  if (split.embedding) flags.push_back("--account-for-embedding-in-pipeline-split");
  if (split.loss) flags.push_back("--account-for-loss-in-pipeline-split");
  std::vector<std::string> counts;
  for (int n : pipeline.stages.counts()) counts.push_back(std::to_string(n));
  return target + ": pipeline stages of " + Join(counts, ", ") + " layers (" + split.Describe() +
         "), recorded in the args, which Megatron-LM does not read them from: load with " + Join(flags, " ");
}

Result<ModelPlace> PlaceOf(const std::string& role, const std::string& key, int block, const PipelineStages& stages) {
  const int pp = stages.pp();
  if (role == "embedding") {
    // Embedding.state_dict_for_save_checkpoint: each module's own state dict.
    RESHARD_ASSIGN_OR_RETURN(auto module, SplitModule(role, key));
    return ModelPlace{0, {"language_model", "embedding", module.first, module.second}};
  }
  if (role == "block") {
    const int stage = stages.StageOf(block);
    return ModelPlace{stage, {"language_model", "encoder",
                              "layers." + std::to_string(block - stages.First(stage)) + "." + key}};
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
    const size_t expert = name.find(kExpert);
    if ((expert != std::string::npos) != (r.rule->expert > 0)) continue;
    if (expert != std::string::npos) name.replace(expert, sizeof(kExpert) - 1, std::to_string(ExpertOf(r)));
    if (name == r.name) return &entry;
  }
  return Status::Unsupported("export --to " + target + ": rule set " + rules.name() + "'s torch_dist section gives "
                             "no key for " + r.name + "; add an entry for it (docs/rules.md)");
}

int ExpertOf(const RankTensor& r) { return r.rule->expert > 0 ? r.rule->ExpertId(r.key) : -1; }

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
