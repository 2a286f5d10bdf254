#include "formats/deepspeed/model/flat_group.h"

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

// Any range of the flat buffer: the pieces of the parameters inside it,
// offsets counted from the range's start.
TEST(FlatGroupTest, FragmentsInAnyRange) {
  const FlatGroup g = WorkedExample();
  const std::vector<Fragment> f = g.FragmentsIn(8, 20);
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(g.slots()[f[0].slot].name, "A");
  EXPECT_EQ(f[0].partition_start, 0);
  EXPECT_EQ(f[0].param_offset, 8);
  EXPECT_EQ(f[0].numel, 2);
  EXPECT_EQ(g.slots()[f[1].slot].name, "B");
  EXPECT_EQ(f[1].partition_start, 2);
  EXPECT_EQ(f[1].numel, 7);
  EXPECT_EQ(f[2].partition_start, 9);
  EXPECT_EQ(f[2].param_offset, 0);
  EXPECT_EQ(f[2].numel, 3);
  EXPECT_TRUE(g.FragmentsIn(22, 24).empty());  // the alignment tail
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
  ASSERT_EQ(g.slots().size(), 2u);
  EXPECT_EQ(g.slots()[1].name, "b");
  EXPECT_EQ(g.slots()[1].offset, 15);
}

}  // namespace
}  // namespace reshard
