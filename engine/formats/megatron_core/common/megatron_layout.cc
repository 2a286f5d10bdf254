#include "formats/megatron_core/common/megatron_layout.h"

#include <re2/re2.h>

#include <algorithm>
#include <cstdio>

#include "formats/megatron_core/common/torch_dist_rules.h"
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

std::string ModelChunkKey(int chunk, int vpp) { return vpp == 1 ? "model" : "model" + std::to_string(chunk); }

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

namespace {

std::vector<std::vector<int>> OneChunkEach(const std::vector<int>& layers) {
  std::vector<std::vector<int>> chunks;
  for (int n : layers) chunks.push_back({n});
  return chunks;
}

}  // namespace

PipelineStages::PipelineStages(std::vector<int> layers) : PipelineStages(OneChunkEach(layers)) {}

PipelineStages::PipelineStages(std::vector<std::vector<int>> chunks) : chunks_(std::move(chunks)) {
  first_ = chunks_;
  for (int v = 0; v < vpp(); ++v) {
    for (int p = 0; p < pp(); ++p) {
      first_[p][v] = total_;
      total_ += chunks_[p][v];
    }
  }
  for (const std::vector<int>& stage : chunks_) {
    int n = 0;
    for (int c : stage) n += c;
    layers_.push_back(n);
  }
}

PipelineStages::Where PipelineStages::Locate(int block) const {
  for (int v = 0; v < vpp(); ++v) {
    for (int p = 0; p < pp(); ++p) {
      if (block >= first_[p][v] && block < first_[p][v] + chunks_[p][v]) return {p, v, block - first_[p][v]};
    }
  }
  return {};
}

std::string PipelineStages::Describe() const {
  std::string out;
  if (std::all_of(layers_.begin(), layers_.end(), [this](int n) { return n == layers_[0]; })) {
    out = Count(layers_.empty() ? 0 : layers_[0], "block") + " per stage";
  } else {
    std::vector<std::string> text;
    for (int n : layers_) text.push_back(std::to_string(n));
    out = "blocks per stage " + Join(text, ", ");
  }
  return vpp() == 1 ? out : out + " in " + std::to_string(vpp()) + " virtual stages each";
}

Result<PipelineStages> ChunkedStages(int layers, int pp, int vpp, const PipelineSplit& split, const SplitFlags& flags) {
  RESHARD_ASSIGN_OR_RETURN(std::vector<int> counts, StageLayerCounts(layers, pp, split, flags));
  if (vpp < 1) return Status::InvalidInput("--vpp " + std::to_string(vpp) + ": a size is at least 1");
  if (vpp == 1) return PipelineStages(std::move(counts));
  if (pp < 2) {
    return Status::InvalidInput("a virtual pipeline (--vpp " + std::to_string(vpp) + ") interleaves the model chunks "
                                "of several pipeline stages, and PP is 1; give --pp 2 or more, or --vpp 1");
  }
  // Megatron-Core's interleaved offsets divide by the stages between the
  // first and the last, which PP 2 with both sizes given leaves none of.
  if (pp == 2 && split.first && split.last) {
    return Status::InvalidInput("Megatron-Core's virtual pipeline does not take both the first and the last stage's "
                                "layers at PP 2 (" + split.Describe() + "); give only " + flags.first);
  }
  std::vector<std::vector<int>> chunks;
  for (int p = 0; p < pp; ++p) {
    const bool embedding = split.embedding && p == 0, loss = split.loss && p == pp - 1;
    const int counted = counts[p] + (embedding ? 1 : 0) + (loss ? 1 : 0);
    if (counted % vpp != 0) {
      return Status::InvalidInput("pipeline stage " + std::to_string(p) + "'s " + Count(counted, "layer") +
                                  (counted == counts[p] ? "" : " (the embedding or loss counted)") +
                                  " do not divide into " + std::to_string(vpp) + " virtual stages, which Megatron-Core "
                                  "gives equal layers; give a --vpp that divides every stage's layers" +
                                  (split.Even() ? "" : ", or other stage sizes"));
    }
    chunks.emplace_back(vpp, counted / vpp);
    if (embedding) chunks[p].front() -= 1;
    if (loss) chunks[p].back() -= 1;
  }
  return PipelineStages(std::move(chunks));
}

std::vector<RegisteredParam> ChunkRegistrationOrder(const TorchDistLayout& layout, const PipelineStages& stages,
                                                    int stage, int chunk, const std::string& tied_head,
                                                    const OptimizerShare& share) {
  return SharedRegistrationOrder(
      StageRegistrationOrder(
          layout.optimizer_order, [&layout](const std::string& key) { return layout.IsStackedKey(key); },
          stages.ChunkFirst(stage, chunk), stages.ChunkLayers(stage, chunk), stage == 0 && chunk == 0,
          stage == stages.pp() - 1 && chunk == stages.vpp() - 1, tied_head),
      [&layout](const std::string& key) { return layout.IsExpertKey(key); }, share);
}

int VppOfArgs(const Value& args) {
  const Value* v = Find(args, kVppArg);
  int64_t n = 0;
  return v != nullptr && ReadInt(*v, &n) && n > 1 ? static_cast<int>(n) : 1;
}

std::vector<FormatOptionInfo> PipelineSplitOptions() {
  using Kind = FormatOptionInfo::Kind;
  return {{kFirstStageOption, Kind::kCount,
           "Megatron-LM's --decoder-first-pipeline-num-layers: the first pipeline stage's transformer layers, the "
           "stages without a size given sharing the rest evenly (default: the source's own split at its own PP, "
           "else even)"},
          {kLastStageOption, Kind::kCount,
           "Megatron-LM's --decoder-last-pipeline-num-layers: the last pipeline stage's transformer layers (default: "
           "the source's own split at its own PP, else even)"},
          {kEmbeddingCountedOption, Kind::kFlag,
           "Megatron-LM's --account-for-embedding-in-pipeline-split: the embedding counted as one more layer of the "
           "first pipeline stage, the layers split evenly with it (default: the source's own split at its own PP, "
           "else even)"},
          {kLossCountedOption, Kind::kFlag,
           "Megatron-LM's --account-for-loss-in-pipeline-split: the loss counted as one more layer of the last "
           "pipeline stage (default: the source's own split at its own PP, else even)"},
          {kVppOption, Kind::kCount,
           "The virtual pipeline: model chunks per pipeline stage, interleaved (Megatron-LM's "
           "--num-virtual-stages-per-pipeline-rank; default: the source's own at its own PP, else 1)"}};
}

namespace {

// The chunks of each stage: --vpp, else the source's own at its own PP, else 1.
int ChooseVpp(const SourceCheckpoint& src, const ExportOptions& options, const Value* args, int pp,
              std::vector<std::string>* notes) {
  if (const int64_t given = FormatCount(options, kVppOption); given > 0) return static_cast<int>(given);
  const int own = args != nullptr ? VppOfArgs(*args) : 1;
  if (own == 1 || src.info().pp == pp) return own;
  notes->push_back("the source's virtual pipeline (" + std::to_string(own) + " model chunks per stage) is its PP " +
                   std::to_string(src.info().pp) + "'s; the PP " + std::to_string(pp) + " written has none (--vpp N "
                   "gives one)");
  return 1;
}

}  // namespace

Result<TargetPipeline> ChooseTargetPipeline(const SourceCheckpoint& src, const ExportOptions& options, int layers,
                                            int pp, std::vector<std::string>* notes) {
  TargetPipeline out;
  const int64_t first = FormatCount(options, kFirstStageOption), last = FormatCount(options, kLastStageOption);
  if (first > 0) out.split.first = static_cast<int>(first);
  if (last > 0) out.split.last = static_cast<int>(last);
  out.split.embedding = FormatFlag(options, kEmbeddingCountedOption);
  out.split.loss = FormatFlag(options, kLossCountedOption);
  const Value* args = Find(src.info().metadata, "args");
  if (args != nullptr && DictItems(*args) == nullptr) args = nullptr;
  if (out.split.Even() && args != nullptr) {
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
  const int vpp = ChooseVpp(src, options, args, pp, notes);
  RESHARD_ASSIGN_OR_RETURN(out.stages, ChunkedStages(layers, pp, vpp, out.split, kExportSplitFlags));
  return out;
}

std::string PipelineLoadNote(const std::string& target, const TargetPipeline& pipeline) {
  const PipelineSplit& split = pipeline.split;
  if (split.Even() && pipeline.vpp() == 1) return "";
  std::vector<std::string> flags;
  if (split.first) flags.push_back("--decoder-first-pipeline-num-layers " + std::to_string(*split.first));
  if (split.last) flags.push_back("--decoder-last-pipeline-num-layers " + std::to_string(*split.last));
  if (split.embedding) flags.push_back("--account-for-embedding-in-pipeline-split");
  if (split.loss) flags.push_back("--account-for-loss-in-pipeline-split");
  const int vpp = pipeline.vpp();
  if (vpp > 1) flags.push_back("--num-virtual-stages-per-pipeline-rank " + std::to_string(vpp));
  std::vector<std::string> counts;
  for (int n : pipeline.stages.counts()) counts.push_back(std::to_string(n));
  return target + ": pipeline stages of " + Join(counts, ", ") + " layers (" + split.Describe() +
         (vpp > 1 ? ", " + std::to_string(vpp) + " virtual stages each" : std::string()) +
         "), recorded in the args, which Megatron-LM does not read them from: load with " + Join(flags, " ");
}

Result<ModelPlace> PlaceOf(const std::string& role, const std::string& key, int block, const PipelineStages& stages) {
  const int last = stages.pp() - 1, last_chunk = stages.vpp() - 1;
  if (role == "embedding") {
    // Embedding.state_dict_for_save_checkpoint: each module's own state dict.
    RESHARD_ASSIGN_OR_RETURN(auto module, SplitModule(role, key));
    return ModelPlace{0, 0, {"language_model", "embedding", module.first, module.second}};
  }
  if (role == "block") {
    const PipelineStages::Where at = stages.Locate(block);
    return ModelPlace{at.stage, at.chunk, {"language_model", "encoder",
                                           "layers." + std::to_string(at.local) + "." + key}};
  }
  if (role == "final_norm") {
    return ModelPlace{last, last_chunk, {"language_model", "encoder", "final_layernorm." + key}};
  }
  if (role == "head") {
    // The untied head's module (LMHeadPipe.lm_head) is Megatron-LM's output_layer.
    RESHARD_ASSIGN_OR_RETURN(auto module, SplitModule(role, key));
    return ModelPlace{last, last_chunk, {"language_model", "output_layer", module.second}};
  }
  return Status::Unsupported("the rule set's '" + role + "' layers have no place in Megatron-LM's GPT model "
                             "(embedding, blocks, final norm, output layer)");
}

ModelPlace HeadEmbeddingPlace(const PipelineStages& stages) {
  return ModelPlace{stages.pp() - 1, stages.vpp() - 1, {"word_embeddings_for_head", "weight"}};
}

Result<const TorchDistTensor*> TorchDistEntryOf(const RuleSet& rules, const RankTensor& r, const std::string& target) {
  for (const TorchDistTensor& entry : rules.section<TorchDistLayout>()->tensors) {
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

PipelineStages::Where ChunkOfModule(const std::string& key, const PipelineStages& stages) {
  if (key.compare(0, sizeof(kEmbedding) - 1, kEmbedding) == 0) return {};
  return {stages.pp() - 1, stages.vpp() - 1, 0};
}

}  // namespace reshard
