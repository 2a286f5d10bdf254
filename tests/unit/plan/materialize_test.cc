// MaterializeRange: any element range of a target equals that range of the
// whole target, for splits on either dim, fills, averages and sources cut
// into several runs (optimizer partitions).
#include "plan/materialize.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>

namespace reshard {
namespace {

// A source shard over `values` (fp32), cut into runs at `cuts`.
SourceShard ShardOf(std::shared_ptr<std::vector<float>> values, std::vector<int64_t> cuts) {
  SourceShard shard;
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(static_cast<int64_t>(values->size()));
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const auto* data = reinterpret_cast<const uint8_t*>(values->data() + cuts[i]);
    shard.runs.push_back({cuts[i], cuts[i + 1] - cuts[i],
                          ByteView{values, data, static_cast<size_t>(cuts[i + 1] - cuts[i]) * 4}});
  }
  return shard;
}

// Two TP ranks of a [rows, cols] fp32 tensor, element values encoding rank and position.
SourceTensor TwoRanks(int64_t rows, int64_t cols, std::vector<int64_t> cuts) {
  SourceTensor t;
  t.dtype = DType::kFloat32;
  t.local_shape = {rows, cols};
  for (int r = 0; r < 2; ++r) {
    auto values = std::make_shared<std::vector<float>>(rows * cols);
    for (int64_t i = 0; i < rows * cols; ++i) (*values)[i] = 1000.0f * r + i;
    t.shards.push_back(ShardOf(values, cuts));
  }
  return t;
}

std::vector<float> Materialize(const SourceTensor& t, const TensorPlan& plan, int64_t begin, int64_t end) {
  std::vector<float> out(end - begin);
  MaterializeRange(t, plan, begin, end, reinterpret_cast<uint8_t*>(out.data()), nullptr);
  return out;
}

// Every [begin, end) of the target equals the same slice of the whole.
void ExpectRangesAgree(const SourceTensor& t, const TensorPlan& plan) {
  const int64_t n = plan.numel();
  const std::vector<float> whole = Materialize(t, plan, 0, n);
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t e = b + 1; e <= n; ++e) {
      const std::vector<float> part = Materialize(t, plan, b, e);
      ASSERT_EQ(std::memcmp(part.data(), whole.data() + b, (e - b) * 4), 0)
          << "range [" << b << ", " << e << ")";
    }
  }
}

// Target [3, 8] = rank 0's [3, 4] beside rank 1's [3, 4] (split dim 1).
TensorPlan RowParallelMerge() {
  TensorPlan plan;
  plan.shape = {3, 8};
  plan.copies = {{0, 1, 0, 0, 4}, {1, 1, 0, 4, 4}};
  return plan;
}

TEST(MaterializeRangeTest, MergingColumnsOfRowParallelShards) {
  const SourceTensor t = TwoRanks(3, 4, {5});
  const TensorPlan plan = RowParallelMerge();
  const std::vector<float> whole = Materialize(t, plan, 0, 24);
  EXPECT_EQ(whole[0], 0.0f);
  EXPECT_EQ(whole[4], 1000.0f);   // row 0, first column of rank 1
  EXPECT_EQ(whole[8], 4.0f);      // row 1 starts with rank 0's row 1
  EXPECT_EQ(whole[23], 1011.0f);
  ExpectRangesAgree(t, plan);
}

TEST(MaterializeRangeTest, SplittingRowsWithPaddingFill) {
  // Target [5, 4]: rows 1..3 of rank 1, then two fill rows of 7.
  const SourceTensor t = TwoRanks(4, 4, {3, 9});
  TensorPlan plan;
  plan.shape = {5, 4};
  plan.copies = {{1, 0, 1, 0, 3}};
  plan.fills = {{0, 3, 2, 7.0}};
  const std::vector<float> whole = Materialize(t, plan, 0, 20);
  EXPECT_EQ(whole[0], 1004.0f);
  EXPECT_EQ(whole[11], 1015.0f);
  EXPECT_EQ(whole[12], 7.0f);
  EXPECT_EQ(whole[19], 7.0f);
  ExpectRangesAgree(t, plan);
}

TEST(MaterializeRangeTest, AverageOfReplicas) {
  const SourceTensor t = TwoRanks(2, 3, {1, 2});
  TensorPlan plan;
  plan.shape = {2, 3};
  plan.average = true;
  const std::vector<float> whole = Materialize(t, plan, 0, 6);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(whole[i], 500.0f + i);
  ExpectRangesAgree(t, plan);
}

TEST(MaterializeRangeTest, ReadBytesCountOnlyTheRange) {
  const SourceTensor t = TwoRanks(3, 4, {});
  std::vector<float> out(5);
  EXPECT_EQ(MaterializeRange(t, RowParallelMerge(), 2, 7, reinterpret_cast<uint8_t*>(out.data()), nullptr), 5 * 4);
}

}  // namespace
}  // namespace reshard
