#include "formats/deepspeed/model/stage_partition.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// The BigScience spec list: _to_float16, embedding, lambda, blocks, lambda,
// final norm, tied head, float16_to_fp32.
std::vector<SpecWeight> BigScienceSpecs(int blocks) {
  std::vector<SpecWeight> specs{{"_to_float16"}, {"EmbeddingPipe"}, {"<lambda>"}};
  for (int i = 0; i < blocks; ++i) specs.push_back({"ParallelTransformerLayerPipe"});
  for (const char* name : {"<lambda>", "MixedFusedLayerNorm", "EmbeddingPipe", "float16_to_fp32"}) {
    specs.push_back({name});
  }
  return specs;
}

std::vector<SpecWeight> MicrosoftSpecs(int blocks) {
  std::vector<SpecWeight> specs{{"_to_float16"}, {"EmbeddingPipe"}};
  for (int i = 0; i < blocks; ++i) specs.push_back({"ParallelTransformerLayerPipe"});
  for (const char* name : {"MixedFusedLayerNorm", "EmbeddingPipe", "float16_to_fp32"}) {
    specs.push_back({name});
  }
  return specs;
}

std::vector<int> BlocksPerStage(const std::vector<SpecWeight>& specs, const std::vector<int>& parts) {
  std::vector<int> blocks;
  for (size_t p = 0; p + 1 < parts.size(); ++p) {
    int n = 0;
    for (int i = parts[p]; i < parts[p + 1]; ++i) n += specs[i].class_name == "ParallelTransformerLayerPipe";
    blocks.push_back(n);
  }
  return blocks;
}

TEST(PartitionTest, UniformSpreadsRemainderOverFirstStages) {
  EXPECT_EQ(PartitionUniform(10, 4), (std::vector<int>{0, 3, 6, 8, 10}));
  EXPECT_EQ(PartitionUniform(2, 4), (std::vector<int>{0, 1, 2, 2, 2}));
}

TEST(PartitionTest, FixtureExamplesFromTheFormatReference) {
  Result<std::vector<int>> bs = PartitionStages("type:transformer", BigScienceSpecs(4), 2);
  ASSERT_TRUE(bs.ok());
  EXPECT_EQ(*bs, (std::vector<int>{0, 5, 11}));
  Result<std::vector<int>> ms = PartitionStages("type:transformer", MicrosoftSpecs(4), 2);
  ASSERT_TRUE(ms.ok());
  EXPECT_EQ(*ms, (std::vector<int>{0, 4, 9}));
}

TEST(PartitionTest, ThirtyBlocksOnFourStages) {
  auto specs = BigScienceSpecs(30);
  Result<std::vector<int>> parts = PartitionStages("type:transformer", specs, 4);
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(BlocksPerStage(specs, *parts), (std::vector<int>{8, 8, 7, 7}));
}

TEST(PartitionTest, UniformMethodCountsEverySpec) {
  auto specs = BigScienceSpecs(24);  // 31 specs
  Result<std::vector<int>> parts = PartitionStages("uniform", specs, 4);
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(*parts, (std::vector<int>{0, 8, 16, 24, 31}));
  EXPECT_EQ(BlocksPerStage(specs, *parts), (std::vector<int>{5, 8, 8, 3}));
}

TEST(PartitionTest, BloomSplitWithEmbeddingWeighted) {
  auto specs = BigScienceSpecs(70);
  Result<std::vector<int>> parts = PartitionStages("type:transformer|embedding", specs, 12);
  ASSERT_TRUE(parts.ok());
  std::vector<int> expected{5};
  for (int i = 0; i < 10; ++i) expected.push_back(6);
  expected.push_back(5);
  EXPECT_EQ(BlocksPerStage(specs, *parts), expected);
}

TEST(PartitionTest, RejectsUnknownMethodAndBadRegex) {
  EXPECT_EQ(PartitionStages("random", BigScienceSpecs(4), 2).status().code(),
            Status::Code::kUnsupported);
  Result<std::vector<int>> bad = PartitionStages("type:(", BigScienceSpecs(4), 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad pipeline partition method"), std::string::npos);
}

}  // namespace
}  // namespace reshard
