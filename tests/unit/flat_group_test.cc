#include "optim/flat_group.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// The worked example of the format reference: A (10), B (7), C (5) at DP 4
// pad to 24 elements, P = 6.
FlatGroup WorkedExample() {
  return FlatGroup({{"A", {10}}, {"B", {7}}, {"C", {5}}}, 4, 8);
}

TEST(FlatGroupTest, AlignmentAndPartitions) {
  const FlatGroup g = WorkedExample();
  EXPECT_EQ(g.numel(), 22);
  EXPECT_EQ(g.padded(), 24);
  EXPECT_EQ(g.partition(), 6);
  EXPECT_EQ(g.PaddingIn(0), 0);
  EXPECT_EQ(g.PaddingIn(3), 2);
}

TEST(FlatGroupTest, FragmentsFollowParamSliceMappings) {
  const FlatGroup g = WorkedExample();
  const std::vector<Fragment> rank1 = g.Fragments(1);
  ASSERT_EQ(rank1.size(), 2u);
  EXPECT_EQ(g.slots()[rank1[0].slot].name, "A");
  EXPECT_EQ(rank1[0].numel, 4);
  EXPECT_EQ(rank1[0].partition_start, 0);
  EXPECT_EQ(rank1[0].param_offset, 6);
  EXPECT_EQ(g.slots()[rank1[1].slot].name, "B");
  EXPECT_EQ(rank1[1].numel, 2);
  EXPECT_EQ(rank1[1].partition_start, 4);
  const std::vector<Fragment> rank3 = g.Fragments(3);
  ASSERT_EQ(rank3.size(), 1u);
  EXPECT_EQ(rank3[0].numel, 4);
  EXPECT_EQ(rank3[0].param_offset, 1);
}

// A small group at large DP: the padding is longer than a partition and the
// last ranks hold nothing but padding.
TEST(FlatGroupTest, PaddingLongerThanAPartition) {
  const FlatGroup g({{"norm", {3}}}, 16, 32);
  EXPECT_EQ(g.padded(), 32);
  EXPECT_EQ(g.partition(), 2);
  EXPECT_EQ(g.PaddingIn(1), 1);
  EXPECT_EQ(g.PaddingIn(2), 2);
  EXPECT_TRUE(g.Fragments(15).empty());
}

TEST(FlatGroupTest, NoAlignmentForTheUnpartitionedFp16Optimizer) {
  const FlatGroup g({{"w", {3, 5}}, {"b", {5}}}, 1, 1);
  EXPECT_EQ(g.padded(), 20);
  EXPECT_EQ(g.Find("b")->offset, 15);
  EXPECT_EQ(g.Find("missing"), nullptr);
}

}  // namespace
}  // namespace reshard
