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

TEST(MegatronLayoutTest, StagesTakeEqualBlocks) {
  EXPECT_EQ(*BlocksPerStage(24, 4), 6);
  EXPECT_EQ(*BlocksPerStage(6, 6), 1);
  Result<int> uneven = BlocksPerStage(6, 4);
  ASSERT_FALSE(uneven.ok());
  EXPECT_EQ(uneven.status().message(),
            "Megatron-LM gives every pipeline stage the same number of transformer blocks, and 6 blocks do not "
            "divide into 4 stages; choose a --pp that divides 6");
  EXPECT_FALSE(BlocksPerStage(2, 4).ok());
  // One block, one stage: no "1 blocks".
  EXPECT_NE(BlocksPerStage(1, 2).status().message().find("and 1 block does not divide into 2 stages"),
            std::string::npos);
}

TEST(MegatronLayoutTest, EmbeddingTensorsAreInTheirModulesOnTheFirstStage) {
  Result<ModelPlace> word = PlaceOf("embedding", "word_embeddings.weight", -1, 3, 2);
  EXPECT_EQ(word->stage, 0);
  EXPECT_EQ(word->path, (Path{"language_model", "embedding", "word_embeddings", "weight"}));
  // BigScience's embedding LayerNorm lives inside the word embedding module.
  EXPECT_EQ(PlaceOf("embedding", "word_embeddings.norm.bias", -1, 3, 2)->path,
            (Path{"language_model", "embedding", "word_embeddings", "norm.bias"}));
  EXPECT_EQ(PlaceOf("embedding", "position_embeddings.weight", -1, 3, 2)->path,
            (Path{"language_model", "embedding", "position_embeddings", "weight"}));
}

TEST(MegatronLayoutTest, BlocksGoToTheirStageUnderLocalIds) {
  Result<ModelPlace> first = PlaceOf("block", "input_layernorm.weight", 2, 3, 2);
  EXPECT_EQ(first->stage, 0);
  EXPECT_EQ(first->path, (Path{"language_model", "encoder", "layers.2.input_layernorm.weight"}));
  Result<ModelPlace> later = PlaceOf("block", "self_attention.dense.weight", 4, 3, 2);
  EXPECT_EQ(later->stage, 1);
  EXPECT_EQ(later->path, (Path{"language_model", "encoder", "layers.1.self_attention.dense.weight"}));
}

TEST(MegatronLayoutTest, FinalNormAndOutputLayerAreOnTheLastStage) {
  Result<ModelPlace> norm = PlaceOf("final_norm", "bias", -1, 2, 3);
  EXPECT_EQ(norm->stage, 2);
  EXPECT_EQ(norm->path, (Path{"language_model", "encoder", "final_layernorm.bias"}));
  Result<ModelPlace> head = PlaceOf("head", "lm_head.weight", -1, 2, 3);
  EXPECT_EQ(head->stage, 2);
  EXPECT_EQ(head->path, (Path{"language_model", "output_layer", "weight"}));
  const ModelPlace tied = HeadEmbeddingPlace(3);
  EXPECT_EQ(tied.stage, 2);
  EXPECT_EQ(tied.path, (Path{"word_embeddings_for_head", "weight"}));
}

TEST(MegatronLayoutTest, WhatMegatronHasNoPlaceForIsRefused) {
  Result<ModelPlace> other = PlaceOf("pooler", "dense.weight", -1, 1, 1);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().message(), "the rule set's 'pooler' layers have no place in Megatron-LM's GPT model "
                                      "(embedding, blocks, final norm, output layer)");
  Result<ModelPlace> bare = PlaceOf("embedding", "weight", -1, 1, 1);
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

TEST(MegatronLayoutTest, MegatronCoreModulesOutsideTheLayersAreOnTheFirstOrLastStage) {
  EXPECT_EQ(StageOfModule("embedding.word_embeddings.weight", 4), 0);
  EXPECT_EQ(StageOfModule("embedding.position_embeddings.weight", 4), 0);
  EXPECT_EQ(StageOfModule("decoder.final_layernorm.weight", 4), 3);
  EXPECT_EQ(StageOfModule("output_layer", 4), 3);
  EXPECT_EQ(StageOfModule("output_layer.weight", 1), 0);
}

}  // namespace
}  // namespace reshard
