// Where the Megatron-LM export puts files and tensors: the file of each
// (tensor, pipeline) rank, the blocks of each stage, each weight's path in
// the legacy model's nested dict or its key in Megatron-Core's.
#include "formats/megatron_core/common/megatron_layout.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

using Path = std::vector<std::string>;

TEST(MegatronLayoutTest, FileNamesHaveThePipelineRankOnlyWithPipelining) {
  EXPECT_EQ(MegatronFileName(10, 0, 0, 1), "iter_0000010/mp_rank_00/model_optim_rng.pt");
  EXPECT_EQ(MegatronFileName(10, 3, 0, 2), "iter_0000010/mp_rank_03_000/model_optim_rng.pt");
  EXPECT_EQ(MegatronFileName(1234567, 12, 104, 128), "iter_1234567/mp_rank_12_104/model_optim_rng.pt");
  EXPECT_EQ(MegatronFileName(12345678, 0, 1, 2), "iter_12345678/mp_rank_00_001/model_optim_rng.pt");
}

TEST(MegatronLayoutTest, RankFoldersAreReadBack) {
  std::optional<RankFolder> plain = ParseRankFolder("mp_rank_03");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->tp_rank, 3);
  EXPECT_EQ(plain->pp_rank, 0);
  EXPECT_FALSE(plain->staged);
  std::optional<RankFolder> staged = ParseRankFolder("mp_rank_12_104");
  ASSERT_TRUE(staged);
  EXPECT_EQ(staged->tp_rank, 12);
  EXPECT_EQ(staged->pp_rank, 104);
  EXPECT_TRUE(staged->staged);
  // DeepSpeed's files and anything else beside them are not rank folders.
  for (const char* other : {"mp_rank_00_model_states.pt", "mp_rank_1", "mp_rank_00_01", "xmp_rank_00", "latest"}) {
    EXPECT_FALSE(ParseRankFolder(other)) << other;
  }
}

TEST(MegatronLayoutTest, LayerKeysSplitIntoTheStackedKeyAndTheLocalIndex) {
  std::optional<std::pair<std::string, int>> layer = SplitLayerKey("decoder.layers.11.mlp.linear_fc1.weight");
  ASSERT_TRUE(layer);
  EXPECT_EQ(layer->first, "decoder.layers.mlp.linear_fc1.weight");
  EXPECT_EQ(layer->second, 11);
  EXPECT_EQ(*LayerKey(layer->first, layer->second), "decoder.layers.11.mlp.linear_fc1.weight");
  EXPECT_FALSE(SplitLayerKey("decoder.final_layernorm.weight"));
  EXPECT_FALSE(SplitLayerKey("decoder.layers.x.mlp.linear_fc1.weight"));
  EXPECT_FALSE(SplitLayerKey("embedding.word_embeddings.weight"));
}

std::vector<int> Counts(int layers, int pp, const PipelineSplit& split) {
  Result<std::vector<int>> counts = StageLayerCounts(layers, pp, split, kExportSplitFlags);
  EXPECT_TRUE(counts.ok()) << counts.status().message();
  return counts.ok() ? *counts : std::vector<int>{};
}

PipelineSplit FirstLast(std::optional<int> first, std::optional<int> last) {
  PipelineSplit split;
  split.first = first;
  split.last = last;
  return split;
}

TEST(MegatronLayoutTest, StagesTakeEqualLayersUnlessTold) {
  EXPECT_EQ(Counts(24, 4, {}), (std::vector<int>{6, 6, 6, 6}));
  EXPECT_EQ(Counts(6, 6, {}), (std::vector<int>{1, 1, 1, 1, 1, 1}));
  Result<std::vector<int>> uneven = StageLayerCounts(3, 2, {}, kExportSplitFlags);
  ASSERT_FALSE(uneven.ok());
  EXPECT_EQ(uneven.status().message(),
            "Megatron-Core splits the transformer layers evenly over the pipeline stages unless given the first or "
            "last stage's, and 3 layers do not divide into 2 stages; give --decoder-first-pipeline-num-layers N or "
            "--decoder-last-pipeline-num-layers N, or a --pp that divides 3");
  EXPECT_FALSE(StageLayerCounts(2, 4, {}, kExportSplitFlags).ok());
}

// Megatron-Core's get_num_layers_to_build: the stages without a size given
// share the rest evenly.
TEST(MegatronLayoutTest, FirstAndLastStageSizesLeaveTheRestEven) {
  EXPECT_EQ(Counts(3, 2, FirstLast(2, std::nullopt)), (std::vector<int>{2, 1}));
  EXPECT_EQ(Counts(3, 2, FirstLast(1, std::nullopt)), (std::vector<int>{1, 2}));
  EXPECT_EQ(Counts(3, 2, FirstLast(std::nullopt, 1)), (std::vector<int>{2, 1}));
  EXPECT_EQ(Counts(3, 2, FirstLast(2, 1)), (std::vector<int>{2, 1}));
  EXPECT_EQ(Counts(11, 4, FirstLast(2, std::nullopt)), (std::vector<int>{2, 3, 3, 3}));
  EXPECT_EQ(Counts(10, 4, FirstLast(1, std::nullopt)), (std::vector<int>{1, 3, 3, 3}));
  EXPECT_EQ(Counts(10, 4, FirstLast(1, 1)), (std::vector<int>{1, 4, 4, 1}));
  EXPECT_EQ(Counts(7, 4, FirstLast(std::nullopt, 1)), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(Counts(5, 1, FirstLast(5, std::nullopt)), (std::vector<int>{5}));
  // Stage sizes that do not add up, or leave the other stages unequal or empty.
  for (const PipelineSplit& bad : {FirstLast(2, 2), FirstLast(3, std::nullopt), FirstLast(0, std::nullopt)}) {
    EXPECT_FALSE(StageLayerCounts(3, 2, bad, kExportSplitFlags).ok()) << bad.Describe();
  }
  Result<std::vector<int>> odd = StageLayerCounts(10, 4, FirstLast(3, std::nullopt), kSetSplitFlags);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(),
            "the pipeline stage sizes (first stage 3) leave 7 layers of 10 for 3 other stages, which Megatron-Core "
            "cannot split evenly; give --set decoder_first_pipeline_num_layers=N and --set "
            "decoder_last_pipeline_num_layers=N that leave each other stage as many layers");
}

// --account-for-embedding/loss-in-pipeline-split: one more layer counted on
// the first / last stage, which builds one layer fewer.
TEST(MegatronLayoutTest, EmbeddingAndLossCountAsLayers) {
  PipelineSplit embedding;
  embedding.embedding = true;
  EXPECT_EQ(Counts(7, 4, embedding), (std::vector<int>{1, 2, 2, 2}));
  PipelineSplit both = embedding;
  both.loss = true;
  EXPECT_EQ(Counts(6, 4, both), (std::vector<int>{1, 2, 2, 1}));
  EXPECT_EQ(Counts(3, 4, embedding), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_FALSE(StageLayerCounts(8, 4, embedding, kExportSplitFlags).ok());
  PipelineSplit mixed = FirstLast(2, std::nullopt);
  mixed.loss = true;
  EXPECT_FALSE(StageLayerCounts(3, 2, mixed, kExportSplitFlags).ok());
}

TEST(MegatronLayoutTest, StageCountsAreReadBackAsStageSizes) {
  EXPECT_TRUE(SplitOfCounts({2, 2, 2})->Even());
  EXPECT_EQ(*SplitOfCounts({2, 1})->first, 2);
  EXPECT_FALSE(SplitOfCounts({2, 1})->last);
  const PipelineSplit ends = *SplitOfCounts({1, 4, 4, 1});
  EXPECT_EQ(ends.first, 1);
  EXPECT_EQ(ends.last, 1);
  EXPECT_FALSE(SplitOfCounts({2, 3, 3, 3})->last);
  EXPECT_EQ(SplitOfCounts({1, 2, 3})->last, 3);
  EXPECT_FALSE(SplitOfCounts({1, 2, 3, 2}).ok());  // the stages between differ
  EXPECT_FALSE(SplitOfCounts({0, 1, 1}).ok());
}

TEST(MegatronLayoutTest, StagesPlaceGlobalLayers) {
  const PipelineStages stages({2, 1, 3});
  EXPECT_EQ(stages.pp(), 3);
  EXPECT_EQ(stages.vpp(), 1);
  EXPECT_EQ(stages.ChunkFirst(1, 0), 2);
  EXPECT_EQ(stages.ChunkFirst(2, 0), 3);
  EXPECT_EQ(stages.Total(), 6);
  EXPECT_EQ(stages.StageOf(0), 0);
  EXPECT_EQ(stages.StageOf(1), 0);
  EXPECT_EQ(stages.StageOf(2), 1);
  EXPECT_EQ(stages.StageOf(5), 2);
  EXPECT_EQ(stages.Describe(), "blocks per stage 2, 1, 3");
  EXPECT_EQ(PipelineStages({3, 3}).Describe(), "3 blocks per stage");
  // A stage without layers (the embedding counted on the first).
  EXPECT_EQ(PipelineStages({0, 1, 1}).StageOf(0), 1);
}

TEST(MegatronLayoutTest, SplitIsReadFromTheArgs) {
  Value args = Value::MakeDict();
  EXPECT_TRUE(SplitOfArgs(args).Even());
  Set(args, "decoder_first_pipeline_num_layers", Value::Int(2));
  Set(args, "decoder_last_pipeline_num_layers", Value::None());
  Set(args, "account_for_loss_in_pipeline_split", Value::Bool(true));
  const PipelineSplit split = SplitOfArgs(args);
  EXPECT_EQ(split.first, 2);
  EXPECT_FALSE(split.last);
  EXPECT_FALSE(split.embedding);
  EXPECT_TRUE(split.loss);
  EXPECT_EQ(split.Describe(), "first stage 2, the loss counted as a layer");
}

TEST(MegatronLayoutTest, EmbeddingTensorsAreInTheirModulesOnTheFirstStage) {
  Result<ModelPlace> word = PlaceOf("embedding", "word_embeddings.weight", -1, PipelineStages({3, 3}));
  EXPECT_EQ(word->stage, 0);
  EXPECT_EQ(word->path, (Path{"language_model", "embedding", "word_embeddings", "weight"}));
  // BigScience's embedding LayerNorm lives inside the word embedding module.
  EXPECT_EQ(PlaceOf("embedding", "word_embeddings.norm.bias", -1, PipelineStages({3, 3}))->path,
            (Path{"language_model", "embedding", "word_embeddings", "norm.bias"}));
  EXPECT_EQ(PlaceOf("embedding", "position_embeddings.weight", -1, PipelineStages({3, 3}))->path,
            (Path{"language_model", "embedding", "position_embeddings", "weight"}));
}

TEST(MegatronLayoutTest, BlocksGoToTheirStageUnderLocalIds) {
  Result<ModelPlace> first = PlaceOf("block", "input_layernorm.weight", 2, PipelineStages({3, 3}));
  EXPECT_EQ(first->stage, 0);
  EXPECT_EQ(first->path, (Path{"language_model", "encoder", "layers.2.input_layernorm.weight"}));
  Result<ModelPlace> later = PlaceOf("block", "self_attention.dense.weight", 4, PipelineStages({3, 3}));
  EXPECT_EQ(later->stage, 1);
  EXPECT_EQ(later->path, (Path{"language_model", "encoder", "layers.1.self_attention.dense.weight"}));
}

TEST(MegatronLayoutTest, FinalNormAndOutputLayerAreOnTheLastStage) {
  Result<ModelPlace> norm = PlaceOf("final_norm", "bias", -1, PipelineStages({2, 2, 2}));
  EXPECT_EQ(norm->stage, 2);
  EXPECT_EQ(norm->path, (Path{"language_model", "encoder", "final_layernorm.bias"}));
  Result<ModelPlace> head = PlaceOf("head", "lm_head.weight", -1, PipelineStages({2, 2, 2}));
  EXPECT_EQ(head->stage, 2);
  EXPECT_EQ(head->path, (Path{"language_model", "output_layer", "weight"}));
  const ModelPlace tied = HeadEmbeddingPlace(PipelineStages({2, 2, 2}));
  EXPECT_EQ(tied.stage, 2);
  EXPECT_EQ(tied.path, (Path{"word_embeddings_for_head", "weight"}));
}

TEST(MegatronLayoutTest, WhatMegatronHasNoPlaceForIsRefused) {
  Result<ModelPlace> other = PlaceOf("pooler", "dense.weight", -1, PipelineStages(std::vector<int>{1}));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().message(), "the rule set's 'pooler' layers have no place in Megatron-LM's GPT model "
                                      "(embedding, blocks, final norm, output layer)");
  Result<ModelPlace> bare = PlaceOf("embedding", "weight", -1, PipelineStages(std::vector<int>{1}));
  ASSERT_FALSE(bare.ok());
  EXPECT_EQ(bare.status().message(), "the embedding tensor 'weight' names no module of Megatron-LM's embedding "
                                     "(expected <module>.<parameter>)");
}

// Megatron-Core's keys: the stacked torch_dist key with the stage's own
// layer index after decoder.layers., as each stage numbers its layers from 0.
TEST(MegatronLayoutTest, MegatronCoreLayerKeysTakeTheStagesLayerIndex) {
  EXPECT_EQ(*LayerKey("decoder.layers.mlp.linear_fc1.weight", 1), "decoder.layers.1.mlp.linear_fc1.weight");
  EXPECT_EQ(*LayerKey("decoder.layers.input_layernorm.weight", 0), "decoder.layers.0.input_layernorm.weight");
  EXPECT_TRUE(IsLayerKey("decoder.layers.self_attention.linear_qkv"));
  EXPECT_FALSE(IsLayerKey("decoder.final_layernorm.weight"));
  Result<std::string> outside = LayerKey("decoder.final_layernorm.weight", 0);
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.status().message(), "the torch_dist key 'decoder.final_layernorm.weight' of a block tensor is "
                                        "not under decoder.layers., where Megatron-Core's GPTModel keeps its "
                                        "layers; fix the rule file's key");
}

TEST(MegatronLayoutTest, MegatronCoreModulesOutsideTheLayersAreOnTheFirstOrLastChunk) {
  const PipelineStages four({1, 1, 1, 1});
  EXPECT_EQ(ChunkOfModule("embedding.word_embeddings.weight", four).stage, 0);
  EXPECT_EQ(ChunkOfModule("embedding.position_embeddings.weight", four).stage, 0);
  EXPECT_EQ(ChunkOfModule("decoder.final_layernorm.weight", four).stage, 3);
  EXPECT_EQ(ChunkOfModule("output_layer", four).stage, 3);
  EXPECT_EQ(ChunkOfModule("output_layer.weight", PipelineStages(std::vector<int>{2})).stage, 0);
  // With a virtual pipeline: the embedding in stage 0's chunk 0, the head in
  // the last stage's last chunk.
  const PipelineStages chunked({{1, 1, 1}, {1, 1, 1}});
  EXPECT_EQ(ChunkOfModule("embedding.word_embeddings.weight", chunked).chunk, 0);
  const PipelineStages::Where head = ChunkOfModule("output_layer.weight", chunked);
  EXPECT_EQ(head.stage, 1);
  EXPECT_EQ(head.chunk, 2);
  EXPECT_EQ(HeadEmbeddingPlace(chunked).chunk, 2);
}

// The global layers of each (stage, chunk) of Megatron-Core's interleaved
// layout, as its get_transformer_layer_offset and get_num_layers_to_build
// give them (megatron/core/transformer/transformer_block.py's own example:
// 8 layers, 2 stages, 2 chunks: stage 0 [0, 1] [4, 5], stage 1 [2, 3] [6, 7]).
std::vector<std::vector<std::pair<int, int>>> FirstAndCount(const PipelineStages& stages) {
  std::vector<std::vector<std::pair<int, int>>> out(stages.pp());
  for (int p = 0; p < stages.pp(); ++p) {
    for (int c = 0; c < stages.vpp(); ++c) out[p].emplace_back(stages.ChunkFirst(p, c), stages.ChunkLayers(p, c));
  }
  return out;
}

using Chunks = std::vector<std::vector<std::pair<int, int>>>;

TEST(MegatronLayoutTest, VirtualStagesTakeTheLayersInTurn) {
  Result<PipelineStages> two = ChunkedStages(8, 2, 2, {}, kExportSplitFlags);
  ASSERT_TRUE(two.ok()) << two.status().message();
  EXPECT_EQ(FirstAndCount(*two), (Chunks{{{0, 2}, {4, 2}}, {{2, 2}, {6, 2}}}));
  Result<PipelineStages> four = ChunkedStages(8, 2, 4, {}, kExportSplitFlags);
  ASSERT_TRUE(four.ok());
  EXPECT_EQ(FirstAndCount(*four), (Chunks{{{0, 1}, {2, 1}, {4, 1}, {6, 1}}, {{1, 1}, {3, 1}, {5, 1}, {7, 1}}}));
  const PipelineStages::Where at = two->Locate(5);
  EXPECT_EQ(at.stage, 0);
  EXPECT_EQ(at.chunk, 1);
  EXPECT_EQ(at.local, 1);
  EXPECT_EQ(two->StageOf(6), 1);
  EXPECT_EQ(two->Layers(1), 4);
  EXPECT_EQ(two->Describe(), "4 blocks per stage in 2 virtual stages each");
  EXPECT_EQ(ModelChunkKey(0, 1), "model");
  EXPECT_EQ(ModelChunkKey(1, 2), "model1");
}

TEST(MegatronLayoutTest, VirtualStagesOfUnevenStagesAndCountedEmbedding) {
  // First stage 4, the 2 others 2 each, 2 chunks: 2 + 1 + 1 layers per round.
  PipelineSplit first;
  first.first = 4;
  Result<PipelineStages> uneven = ChunkedStages(8, 3, 2, first, kExportSplitFlags);
  ASSERT_TRUE(uneven.ok()) << uneven.status().message();
  EXPECT_EQ(FirstAndCount(*uneven), (Chunks{{{0, 2}, {4, 2}}, {{2, 1}, {6, 1}}, {{3, 1}, {7, 1}}}));
  // 7 layers and the embedding counted: 8 over 2 stages of 2 chunks, stage
  // 0's chunk 0 one layer short; the loss counted too: the last chunk short.
  PipelineSplit embedding;
  embedding.embedding = true;
  Result<PipelineStages> counted = ChunkedStages(7, 2, 2, embedding, kExportSplitFlags);
  ASSERT_TRUE(counted.ok()) << counted.status().message();
  EXPECT_EQ(FirstAndCount(*counted), (Chunks{{{0, 1}, {3, 2}}, {{1, 2}, {5, 2}}}));
  embedding.loss = true;
  Result<PipelineStages> both = ChunkedStages(6, 2, 2, embedding, kExportSplitFlags);
  ASSERT_TRUE(both.ok()) << both.status().message();
  EXPECT_EQ(FirstAndCount(*both), (Chunks{{{0, 1}, {3, 2}}, {{1, 2}, {5, 1}}}));
}

TEST(MegatronLayoutTest, VirtualStagesMegatronCannotBuildAreRefused) {
  Result<PipelineStages> odd = ChunkedStages(6, 2, 2, {}, kExportSplitFlags);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(), "pipeline stage 0's 3 layers do not divide into 2 virtual stages, which "
                                    "Megatron-Core gives equal layers; give a --vpp that divides every stage's layers");
  Result<PipelineStages> alone = ChunkedStages(4, 1, 2, {}, kExportSplitFlags);
  ASSERT_FALSE(alone.ok());
  EXPECT_EQ(alone.status().message(), "a virtual pipeline (--vpp 2) interleaves the model chunks of several pipeline "
                                      "stages, and PP is 1; give --pp 2 or more, or --vpp 1");
  PipelineSplit ends;
  ends.first = 2;
  ends.last = 2;
  EXPECT_FALSE(ChunkedStages(4, 2, 2, ends, kExportSplitFlags).ok());
  EXPECT_TRUE(ChunkedStages(6, 3, 2, ends, kExportSplitFlags).ok());
  EXPECT_TRUE(ChunkedStages(6, 1, 1, {}, kExportSplitFlags).ok());
}

TEST(MegatronLayoutTest, VppIsReadFromTheArgs) {
  Value args = Value::MakeDict();
  EXPECT_EQ(VppOfArgs(args), 1);
  Set(args, kVppArg, Value::None());
  EXPECT_EQ(VppOfArgs(args), 1);
  Set(args, kVppArg, Value::Int(4));
  EXPECT_EQ(VppOfArgs(args), 4);
}

}  // namespace
}  // namespace reshard
