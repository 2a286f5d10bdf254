// Where NVIDIA Megatron-LM's `torch` checkpoint format puts things
// (megatron-deepspeed-format.md §13, §5.1): the file of each (tensor,
// pipeline) rank, the blocks of each pipeline stage and of its model chunks
// (a virtual pipeline's `model0`, `model1`, ...), and each weight's place
// in the `model` dict that GPTModel.state_dict_for_save_checkpoint writes —
// nested for the legacy GPTModel, one flat key per tensor for Megatron-Core's
// (the torch_dist section's key with the stage's own layer index), and which
// torch_dist key a rank tensor has.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/format.h"
#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "reshard/status.h"
#include "rules/rule_set.h"

namespace reshard {

// The root file naming the checkpoint's iteration.
inline constexpr char kLatestIterationFile[] = "latest_checkpointed_iteration.txt";

// "iter_0000010/mp_rank_01/model_optim_rng.pt" when pp == 1, else
// "iter_0000010/mp_rank_01_002/model_optim_rng.pt".
std::string MegatronFileName(int64_t iteration, int tp_rank, int pp_rank, int pp);

// The key of a rank file's model chunk `chunk` of `vpp`: "model" without a
// virtual pipeline, else "model0", "model1", ... (Megatron-LM's
// generate_state_dict).
std::string ModelChunkKey(int chunk, int vpp);

// The name of a rank's folder (MegatronFileName's middle part):
// "mp_rank_01" -> {1, 0, false}, "mp_rank_01_002" -> {1, 2, true}; nullopt
// for any other name.
struct RankFolder {
  int tp_rank = 0, pp_rank = 0;
  bool staged = false;  // named with a pipeline rank (PP > 1)
};
std::optional<RankFolder> ParseRankFolder(const std::string& name);

// How Megatron-Core splits the transformer layers over the pipeline stages:
// evenly, unless the run gave Megatron-LM's --decoder-first-pipeline-num-layers /
// --decoder-last-pipeline-num-layers (the first / last stage's layers, the
// others share the rest evenly), or counted the embedding or the loss as one
// more layer of the first / last stage (--account-for-embedding-in-pipeline-split,
// --account-for-loss-in-pipeline-split), which Megatron-Core does not combine
// with the stage sizes.
// Its fields in Megatron-LM's args are kPipelineSplitArgs (rules/rule_set.h).
struct PipelineSplit {
  std::optional<int> first, last;
  bool embedding = false, loss = false;

  bool Even() const { return !first && !last && !embedding && !loss; }
  // "first stage 2, last stage 1", "the embedding counted", ...; "even".
  std::string Describe() const;
};

// The split a run's args record: `field(name)` gives an args field as an
// integer (a bool as 0 / 1), nullopt where the args do not record it (or
// record None).
PipelineSplit SplitOfArgs(const std::function<std::optional<int64_t>(const std::string& field)>& field);
PipelineSplit SplitOfArgs(const Value& args);

// The layers of each of `pp` stages of a model of `layers` transformer
// layers, as Megatron-Core 0.19 builds them for `split` (its
// get_num_layers_to_build, without a virtual pipeline). Refused, in one
// line naming the fix (`flags`: how the user gives the stage sizes), for a
// split Megatron-Core refuses or that does not add up to `layers`.
struct SplitFlags {
  std::string first, last;  // "--decoder-first-pipeline-num-layers N", "--set decoder_first_pipeline_num_layers=N"
};
extern const SplitFlags kExportSplitFlags, kSetSplitFlags;
Result<std::vector<int>> StageLayerCounts(int layers, int pp, const PipelineSplit& split, const SplitFlags& flags);

// `counts` (each stage's layers) as Megatron-LM's stage sizes: even, or the
// first and / or last stage's layers with the others equal. Refused for
// counts no Megatron-Core run lays out.
Result<PipelineSplit> SplitOfCounts(const std::vector<int>& counts);

// The layers of each pipeline stage and of each of its model chunks: one
// chunk of consecutive layers per stage, or with a virtual pipeline
// (Megatron-LM's --num-virtual-stages-per-pipeline-rank V, the args'
// virtual_pipeline_model_parallel_size) V chunks per stage, each built as a
// model of its own. The chunks take the layers in turn: every stage's chunk 0
// in stage order, then every stage's chunk 1, ... (8 layers, PP 2, V 2:
// stage 0 holds [0, 1] [4, 5], stage 1 [2, 3] [6, 7]), as Megatron-Core's
// get_transformer_layer_offset numbers them for every split it lays out. The
// embedding is in stage 0's chunk 0, the final norm and output layer in the
// last stage's last chunk.
class PipelineStages {
 public:
  PipelineStages() = default;
  // layers[p]: stage p's layers, one chunk.
  explicit PipelineStages(std::vector<int> layers);
  // chunks[p][v]: the layers of stage p's chunk v; every stage has as many.
  explicit PipelineStages(std::vector<std::vector<int>> chunks);

  int pp() const { return static_cast<int>(chunks_.size()); }
  int vpp() const { return chunks_.empty() ? 1 : static_cast<int>(chunks_[0].size()); }
  // All the stage's chunks' layers.
  int Layers(int stage) const { return layers_[stage]; }
  int ChunkLayers(int stage, int chunk) const { return chunks_[stage][chunk]; }
  // The global index of the chunk's first layer.
  int ChunkFirst(int stage, int chunk) const { return first_[stage][chunk]; }
  // The layers of every stage.
  int Total() const { return total_; }
  // Where global layer `block` is: its stage, chunk and index in the chunk.
  struct Where {
    int stage = 0, chunk = 0, local = 0;
  };
  Where Locate(int block) const;  // REQUIRES: 0 <= block < Total()
  int StageOf(int block) const { return Locate(block).stage; }
  // Each stage's layers.
  const std::vector<int>& counts() const { return layers_; }
  // "2 blocks per stage", "blocks per stage 2, 1", "... in 2 virtual stages each".
  std::string Describe() const;

 private:
  std::vector<std::vector<int>> chunks_, first_;
  std::vector<int> layers_;
  int total_ = 0;
};

// The stages of `layers` layers on `pp` stages of `vpp` chunks each, as
// Megatron-Core builds them (get_num_layers_to_build, get_transformer_layer_offset):
// each stage's layers (StageLayerCounts, the embedding and the loss counted
// where `split` counts them) cut into `vpp` equal chunks, the counted
// embedding then taken from stage 0's chunk 0 and the loss from the last
// chunk. Refused in one line, naming the fix, for a split Megatron-Core
// refuses, a stage whose layers do not divide into `vpp` chunks, and a
// virtual pipeline at PP 1.
Result<PipelineStages> ChunkedStages(int layers, int pp, int vpp, const PipelineSplit& split, const SplitFlags& flags);

// The parameters model chunk `chunk` of stage `stage` registers that the
// optimizer of `share` holds, in order: StageRegistrationOrder
// (megatron_buckets.h) of the rule set's optimizer_order over the chunk's
// layers, the embedding's keys on stage 0's chunk 0, the final ones (and
// `tied_head`, "" for none) on the last stage's last chunk; each layer's
// expert keys once per expert held (SharedRegistrationOrder).
std::vector<RegisteredParam> ChunkRegistrationOrder(const TorchDistLayout& layout, const PipelineStages& stages,
                                                    int stage, int chunk, const std::string& tied_head,
                                                    const OptimizerShare& share);

// The virtual pipeline size `args` record (1 where None or absent).
inline constexpr char kVppArg[] = "virtual_pipeline_model_parallel_size";
int VppOfArgs(const Value& args);

// The options of the Megatron-Core exports that set the target's stage
// sizes, under Megatron-LM's flag names.
inline constexpr char kFirstStageOption[] = "decoder-first-pipeline-num-layers";
inline constexpr char kLastStageOption[] = "decoder-last-pipeline-num-layers";
inline constexpr char kEmbeddingCountedOption[] = "account-for-embedding-in-pipeline-split";
inline constexpr char kLossCountedOption[] = "account-for-loss-in-pipeline-split";
inline constexpr char kVppOption[] = "vpp";  // the model chunks of each stage
std::vector<FormatOptionInfo> PipelineSplitOptions();

// The stages an export to `pp` stages of `layers` layers writes, and the
// split its args record: the stage sizes (or the embedding or loss counted)
// given as options; else the
// source's own split where it was saved at `pp` stages (a note says when
// the source's uneven split is not kept); else even. The chunks of each
// stage: --vpp, else 1 (a note says when the source's virtual pipeline is
// not kept).
struct TargetPipeline {
  PipelineSplit split;
  PipelineStages stages;
  int vpp() const { return stages.vpp(); }
};
Result<TargetPipeline> ChooseTargetPipeline(const SourceCheckpoint& src, const ExportOptions& options, int layers,
                                            int pp, std::vector<std::string>* notes);

// What a loader of an export with `pipeline` must be told (Megatron-LM does
// not take the stage sizes from the checkpoint's args, nor the virtual
// pipeline without --use-mp-args-from-checkpoint-args): "" when even without
// a virtual pipeline, else a note naming Megatron-LM's flags, led by
// `target` ("torch_dist").
std::string PipelineLoadNote(const std::string& target, const TargetPipeline& pipeline);

// Where one weight goes.
struct ModelPlace {
  int stage = 0;
  int chunk = 0;  // the model chunk of the stage (a virtual pipeline's `model{chunk}`)
  // Keys from `model` down; the last is the tensor's key in its module's
  // state dict: {"language_model", "encoder", "layers.0.input_layernorm.weight"}.
  std::vector<std::string> path;
};

// The place of the weight `key` (module-local, as in the DeepSpeed layer
// file) of a layer of `role` — block `block` for blocks, a global index,
// written with its chunk's own index — in `stages`.
Result<ModelPlace> PlaceOf(const std::string& role, const std::string& key, int block, const PipelineStages& stages);

// The last stage's copy of a tied word embedding (PP > 1), in the last chunk.
ModelPlace HeadEmbeddingPlace(const PipelineStages& stages);

// The entry of the rule set's torch_dist section that names rank tensor `r`
// (its canonical name, {block} filled in); `target` is the export, for the message.
Result<const TorchDistTensor*> TorchDistEntryOf(const RuleSet& rules, const RankTensor& r, const std::string& target);

// Whether `t` is a word embedding tied to the output layer, which Megatron
// copies to the last pipeline stage at PP > 1.
bool IsTiedVocab(const RankTensor& t);

// The global expert `r` is of (its rule's expert id in its key); -1 when its
// rule has no expert axis.
int ExpertOf(const RankTensor& r);

// The dtype `t` is written in: `dtype` for a floating tensor when given.
DType WrittenDType(const RankTensor& t, const std::optional<DType>& dtype);

// Megatron-Core's key of block `local_block` of a stage for a stacked
// torch_dist key: ("decoder.layers.mlp.linear_fc1.weight", 1) ->
// "decoder.layers.1.mlp.linear_fc1.weight", as a stage numbers its layers
// from 0.
Result<std::string> LayerKey(const std::string& stacked, int local_block);

// LayerKey backwards: "decoder.layers.1.mlp.linear_fc1.weight" ->
// {"decoder.layers.mlp.linear_fc1.weight", 1}; nullopt when `key` is not a
// layer's.
std::optional<std::pair<std::string, int>> SplitLayerKey(const std::string& key);

// Whether a torch_dist key or module is one per layer ("decoder.layers....").
bool IsLayerKey(const std::string& key);

// The chunk holding a module outside the layers: the embedding's is the
// first stage's first (pre_process), the final norm's and output layer's
// the last stage's last (post_process); `local` is unused.
PipelineStages::Where ChunkOfModule(const std::string& key, const PipelineStages& stages);

}  // namespace reshard
