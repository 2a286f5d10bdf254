#include "util/shape.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(ShapeTest, CheckedNumelRefusesWhatCannotBeCounted) {
  EXPECT_EQ(CheckedShapeNumel({}), 1);
  EXPECT_EQ(CheckedShapeNumel({3, 0, int64_t{1} << 62}), 0);
  EXPECT_EQ(CheckedShapeNumel({int64_t{1} << 31, int64_t{1} << 31}), int64_t{1} << 62);
  EXPECT_EQ(CheckedShapeNumel({int64_t{1} << 31, (int64_t{1} << 31) + 1}), -1);
  EXPECT_EQ(CheckedShapeNumel({int64_t{1} << 32, int64_t{1} << 32}), -1);  // 2^64 wraps to 0
  EXPECT_EQ(CheckedShapeNumel({4, -1}), -1);
  EXPECT_EQ(CheckedShapeNumel({-2, -2}), -1);
}

}  // namespace
}  // namespace reshard
