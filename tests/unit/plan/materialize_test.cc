// MaterializeRange: any element range of a target equals that range of the
// whole target, for splits on either dim, fills, averages and sources cut
// into several runs (optimizer partitions).
#include "plan/materialize.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "plan/slicing.h"

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
  plan.copies = {{0, {3, 4}, {0, 0}, Box::Slab(plan.shape, 1, 0, 4)},
                 {1, {3, 4}, {0, 0}, Box::Slab(plan.shape, 1, 4, 4)}};
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
  plan.copies = {{1, {4, 4}, {1, 0}, Box::Slab(plan.shape, 0, 0, 3)}};
  plan.fills = {{Box::Slab(plan.shape, 0, 3, 2), 7.0}};
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

// A [2, 4, 6] tensor stored as four [1, 4, 3] shards, one per (layer, column
// half): a stacked layer axis cut by pipeline stage and a row-parallel cut by
// TP at once. Each copy is a box cut on two axes.
TEST(MaterializeRangeTest, BoxesCutOnTwoAxes) {
  SourceTensor t;
  t.dtype = DType::kFloat32;
  TensorPlan plan;
  plan.shape = {2, 4, 6};
  plan.cut_axis = -1;
  for (int layer = 0; layer < 2; ++layer) {
    for (int half = 0; half < 2; ++half) {
      auto values = std::make_shared<std::vector<float>>(12);
      for (int64_t i = 0; i < 12; ++i) {
        (*values)[i] = static_cast<float>(100 * layer + 6 * (i / 3) + 3 * half + i % 3);  // its global index
      }
      plan.copies.push_back({static_cast<int>(t.shards.size()), {1, 4, 3}, {0, 0, 0},
                             Box{{layer, 0, 3 * half}, {1, 4, 3}}});
      t.shards.push_back(ShardOf(values, {5}));
    }
  }
  const std::vector<float> whole = Materialize(t, plan, 0, 48);
  for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(whole[i], 100 * (i / 24) + i % 24) << i;
  ExpectRangesAgree(t, plan);
  EXPECT_EQ(DescribeSources(plan).substr(0, 31), "[0,1)x[0,4)x[0,3) <- tp0[0,1)x[");
}

// A box from the middle of a source shard on both axes: rows 1-2, columns 2-4
// of a [4, 6] source land at rows 0-1, columns 1-3 of a [2, 5] target whose
// other columns are filled.
TEST(MaterializeRangeTest, BoxFromTheMiddleOfASource) {
  const SourceTensor t = TwoRanks(4, 6, {7});
  TensorPlan plan;
  plan.shape = {2, 5};
  plan.copies = {{1, {4, 6}, {1, 2}, Box{{0, 1}, {2, 3}}}};
  plan.fills = {{Box{{0, 0}, {2, 1}}, -1.0}, {Box{{0, 4}, {2, 1}}, -2.0}};
  const std::vector<float> whole = Materialize(t, plan, 0, 10);
  const std::vector<float> want = {-1, 1008, 1009, 1010, -2, -1, 1014, 1015, 1016, -2};
  EXPECT_EQ(whole, want);
  ExpectRangesAgree(t, plan);
}

// Rows 0-2 and 3-4 of a [5, 4] tensor stored as uneven chunks of different
// shapes (as torch writes a Shard(0) of 5 rows over 2 ranks), joined through
// their placements and cut again as rows 1-3.
TEST(MaterializeRangeTest, UnevenChunksByTheirPlacements) {
  SourceTensor t;
  t.dtype = DType::kFloat32;
  for (int64_t first : {0, 3}) {
    const int64_t rows = first == 0 ? 3 : 2;
    auto values = std::make_shared<std::vector<float>>(rows * 4);
    for (int64_t i = 0; i < rows * 4; ++i) (*values)[i] = static_cast<float>(first * 4 + i);
    SourceShard shard = ShardOf(values, {});
    shard.shape = {rows, 4};
    shard.placements = {Placement{Box{{first, 0}, {rows, 4}}, {0, 0}}};
    t.shards.push_back(std::move(shard));
  }
  TensorPlan plan;
  plan.shape = {3, 4};
  const std::vector<Placement> rows_1_to_3 = {Placement{Box{{1, 0}, {3, 4}}, {0, 0}}};
  plan.copies = IntersectPlacements(rows_1_to_3, t.shards, Box::Whole({5, 4}));
  ASSERT_EQ(plan.copies.size(), 2u);
  const std::vector<float> whole = Materialize(t, plan, 0, 12);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(whole[i], 4 + i);
  ExpectRangesAgree(t, plan);
}

// A file holding two [3, 4] fp32 ranks back to back (rank r's element i is
// 1000 r + i), mapped, and the tensor of its two shards; MapRanks makes the
// ranks' rows wider.
class MappedSourceTest : public ::testing::Test {
 protected:
  void SetUp() override { MapRanks(4); }

  void MapRanks(int64_t columns) {
    const int64_t per_rank = 3 * columns;
    std::vector<float> values(2 * per_rank);
    for (int64_t i = 0; i < 2 * per_rank; ++i) values[i] = 1000.0f * (i / per_rank) + i % per_rank;
    const std::string path = ::testing::TempDir() + "/materialize_mapped_" + std::to_string(::getpid());
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(values.data(), 4, values.size(), f);
    std::fclose(f);
    file_ = *MappedFile::Open(path);
    std::remove(path.c_str());  // the mapping and the descriptor keep it
    source_.dtype = DType::kFloat32;
    source_.shards.clear();
    for (int r = 0; r < 2; ++r) {
      SourceShard shard;
      shard.runs.push_back({0, per_rank, ByteView{file_, file_->data() + 4 * per_rank * r,
                                                  static_cast<size_t>(4 * per_rank), /*mapped=*/true}});
      source_.shards.push_back(shard);
    }
  }

  FileSpans SpansOf(const TensorPlan& plan, int64_t begin, int64_t end, std::vector<float>* out) {
    out->assign(static_cast<size_t>(end - begin), 0.0f);
    auto* dst = reinterpret_cast<uint8_t*>(out->data());
    FileSpans spans;
    MaterializeRange(source_, plan, begin, end, dst, nullptr, SpanSink(&spans, dst, (end - begin) * 4));
    // Noted copy by copy; the writer takes them in any order.
    std::sort(spans.begin(), spans.end(), [](const FileSpan& a, const FileSpan& b) { return a.at < b.at; });
    return spans;
  }

  std::shared_ptr<const MappedFile> file_;
  SourceTensor source_;
};

TEST_F(MappedSourceTest, ARowMergeIsOneSpanOfTheFile) {
  // Target [6, 4] = rank 0's rows, then rank 1's: the file as it lies.
  TensorPlan plan;
  plan.shape = {6, 4};
  plan.copies = {{0, {3, 4}, {0, 0}, Box::Slab(plan.shape, 0, 0, 3)},
                 {1, {3, 4}, {0, 0}, Box::Slab(plan.shape, 0, 3, 3)}};
  std::vector<float> out;
  const FileSpans spans = SpansOf(plan, 2, 20, &out);
  EXPECT_EQ(out[0], 2.0f);
  EXPECT_EQ(out[17], 1007.0f);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].fd, file_->fd());
  EXPECT_EQ(spans[0].at, 0);
  EXPECT_EQ(spans[0].offset, 8);
  EXPECT_EQ(spans[0].length, 72);
}

// Row pieces too short for the kernel copy are read a shard at a time and
// spread: no span, the right values.
TEST_F(MappedSourceTest, AColumnMergeOfShortRowsIsNoSpanAndFillsAreNone) {
  TensorPlan plan = RowParallelMerge();
  std::vector<float> out;
  EXPECT_TRUE(SpansOf(plan, 0, 24, &out).empty());
  EXPECT_EQ(out[4], 1000.0f);  // row 0, first column of rank 1
  EXPECT_EQ(out[8], 4.0f);     // row 1 starts with rank 0's row 1
  EXPECT_EQ(out[23], 1011.0f);
  EXPECT_TRUE(SpansOf(plan, 6, 19, &out).empty());  // a range that cuts pieces
  EXPECT_EQ(out[0], 1002.0f);
  EXPECT_EQ(out[7], 1005.0f);   // row 1, second column of rank 1
  EXPECT_EQ(out[12], 10.0f);    // row 2, third column of rank 0

  plan.shape = {4, 8};  // a last row of fill
  plan.fills = {{Box::Slab(plan.shape, 0, 3, 1), 7.0}};
  EXPECT_TRUE(SpansOf(plan, 0, 32, &out).empty());
  EXPECT_EQ(out[31], 7.0f);
  EXPECT_EQ(out[23], 1011.0f);

  TensorPlan split;  // the last two columns of rank 1: read through the first two of each row
  split.shape = {3, 2};
  split.copies = {{1, {3, 4}, {0, 2}, Box::Whole(split.shape)}};
  EXPECT_TRUE(SpansOf(split, 1, 6, &out).empty());
  EXPECT_EQ(out, (std::vector<float>{1003, 1006, 1007, 1010, 1011}));
}

// Row pieces as long as a kernel copy takes are each a span of the file.
TEST_F(MappedSourceTest, AColumnMergeOfLongRowsIsASpanPerRowPiece) {
  const int64_t columns = 4096;  // 16 KiB per row piece
  MapRanks(columns);
  TensorPlan plan;
  plan.shape = {3, 2 * columns};
  plan.copies = {{0, {3, columns}, {0, 0}, Box::Slab(plan.shape, 1, 0, columns)},
                 {1, {3, columns}, {0, 0}, Box::Slab(plan.shape, 1, columns, columns)}};
  std::vector<float> out;
  const FileSpans spans = SpansOf(plan, 0, 6 * columns, &out);
  ASSERT_EQ(spans.size(), 6u);  // rank 0's row 0, rank 1's row 0, ...
  EXPECT_EQ(spans[1].at, 4 * columns);
  EXPECT_EQ(spans[1].offset, 4 * 3 * columns);
  EXPECT_EQ(spans[1].length, 4 * columns);
  EXPECT_EQ(out[columns], 1000.0f);

  plan.average = true;  // values computed: nothing is a file's bytes
  plan.shape = {3, columns};
  EXPECT_TRUE(SpansOf(plan, 0, 3 * columns, &out).empty());
}

TEST_F(MappedSourceTest, OnlyAWholeUnchangedShardLiesInPlace) {
  std::atomic<int64_t> read{0};
  TensorPlan whole;  // rank 1's shard as it is
  whole.shape = {3, 4};
  whole.copies = {{1, {3, 4}, {0, 0}, Box::Whole(whole.shape)}};
  const ByteProducer produce = RangeProducer(source_, whole, &read);
  ASSERT_NE(produce.in_place(), nullptr);
  EXPECT_EQ(produce.in_place()->span.fd, file_->fd());
  EXPECT_EQ(produce.in_place()->span.offset, 48);
  EXPECT_EQ(produce.in_place()->span.length, 48);
  EXPECT_TRUE(produce.in_place()->check().ok());
  EXPECT_EQ(read.load(), 48);

  TensorPlan rows = whole;  // two of its rows: a part, so made by copying
  rows.shape = {2, 4};
  rows.copies = {{1, {3, 4}, {1, 0}, Box::Whole(rows.shape)}};
  EXPECT_EQ(RangeProducer(source_, rows, &read).in_place(), nullptr);
  TensorPlan merged;  // both shards one after the other: a span of the file, but of two shards
  merged.shape = {6, 4};
  merged.copies = {{0, {3, 4}, {0, 0}, Box::Slab(merged.shape, 0, 0, 3)},
                   {1, {3, 4}, {0, 0}, Box::Slab(merged.shape, 0, 3, 3)}};
  EXPECT_EQ(RangeProducer(source_, merged, &read).in_place(), nullptr);
  TensorPlan padded = whole;  // a fill too
  padded.shape = {4, 4};
  padded.fills = {{Box::Slab(padded.shape, 0, 3, 1), 0.0}};
  EXPECT_EQ(RangeProducer(source_, padded, &read).in_place(), nullptr);
}

}  // namespace
}  // namespace reshard
