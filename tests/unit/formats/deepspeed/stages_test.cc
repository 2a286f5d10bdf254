#include "formats/deepspeed/model/stages.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

Value Metadata(const std::vector<std::vector<int64_t>>& shapes) {
  Items group;
  for (size_t i = 0; i < shapes.size(); ++i) {
    group.emplace_back(Value::String("p" + std::to_string(i)), MakeTorchSize(shapes[i]));
  }
  return Value::MakeDict({{Value::String("param_shapes"),
                           Value::MakeList({MakeOrderedDict(std::move(group))})}});
}

// The counts of param_shapes size flat group layouts; they must add up in int64.
TEST(StagesTest, ParamShapesWithCountsThatOverflowAreMalformed) {
  std::vector<std::vector<ParamShape>> out;
  ASSERT_TRUE(ReadParamShapes(Metadata({{4, 8}, {4}}), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0][1].second, (std::vector<int64_t>{4}));
  const int64_t big = int64_t{1} << 32;
  for (const auto& shapes : std::vector<std::vector<std::vector<int64_t>>>{
           {{big, big}},                                   // 2^64 elements: wraps to 0
           {{4, -2}},                                      // negative dims
           {{int64_t{1} << 61}, {int64_t{1} << 61}, {1}},  // the group's total
       }) {
    std::vector<std::vector<ParamShape>> refused;
    EXPECT_FALSE(ReadParamShapes(Metadata(shapes), &refused));
  }
}

}  // namespace
}  // namespace reshard
