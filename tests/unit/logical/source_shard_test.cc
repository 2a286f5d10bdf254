// JoinRuns: the elements of a whole tensor, or of one layer (or one expert
// of a layer) of a stacked one, as runs of the pieces that hold its boxes — TP ranks' pieces of a
// split tensor (several boxes per piece for SwiGLU's halves) and DCP chunks.
#include "logical/source_shard.h"

#include <gtest/gtest.h>

#include <memory>

#include "logical/tp_placement.h"
#include "rules/rule_set.h"

namespace reshard {
namespace {

// A piece of `shape` whose element i is `base + i` (fp32), at `placements`.
SourceShard Piece(std::vector<int64_t> shape, float base, std::vector<Placement> placements) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  auto values = std::make_shared<std::vector<float>>(n);
  for (int64_t i = 0; i < n; ++i) (*values)[i] = base + static_cast<float>(i);
  SourceShard shard;
  shard.shape = std::move(shape);
  shard.placements = std::move(placements);
  shard.runs.push_back({0, n, ByteView{values, reinterpret_cast<const uint8_t*>(values->data()),
                                       static_cast<size_t>(n) * 4}});
  return shard;
}

std::vector<float> Elements(const SourceShard& joined) {
  std::vector<float> out(joined.numel());
  joined.Copy(0, joined.numel(), 4, reinterpret_cast<uint8_t*>(out.data()), nullptr);
  return out;
}

// Two TP ranks of a [4, 3] tensor split on `dim` in `parts` parts.
std::vector<SourceShard> TwoRanks(int dim, int parts) {
  ParamRule rule;
  rule.policy = ParamRule::Policy::kSplit;
  rule.dim = dim;
  rule.parts = parts;
  std::vector<SourceShard> pieces;
  for (int r = 0; r < 2; ++r) {
    TpPlacement at = PlaceTpRank(rule, {4, 2}, 2, r);
    pieces.push_back(Piece(at.shape, 100.0f * r, at.placements));
  }
  return pieces;
}

TEST(JoinRunsTest, RowsSplitAcrossRanksFollowEachOther) {
  const SourceShard joined = JoinRuns(TwoRanks(0, 1), {4, 2}, 4, -1);
  EXPECT_EQ(joined.shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(Elements(joined), (std::vector<float>{0, 1, 2, 3, 100, 101, 102, 103}));
  EXPECT_EQ(joined.runs.size(), 2u);  // one run per rank: rows are contiguous in each
}

TEST(JoinRunsTest, ColumnsSplitAcrossRanksInterleaveRowByRow) {
  const SourceShard joined = JoinRuns(TwoRanks(1, 1), {4, 2}, 4, -1);
  EXPECT_EQ(Elements(joined), (std::vector<float>{0, 100, 1, 101, 2, 102, 3, 103}));
}

TEST(JoinRunsTest, EachRankHoldsItsSliceOfEveryPart) {
  // SwiGLU: rank r holds [gate_r; up_r]; the whole is [gate_0; gate_1; up_0; up_1].
  const SourceShard joined = JoinRuns(TwoRanks(0, 2), {4, 2}, 4, -1);
  EXPECT_EQ(Elements(joined), (std::vector<float>{0, 1, 100, 101, 2, 3, 102, 103}));
}

TEST(JoinRunsTest, ALayerOfAStackedTensorIsSlicedOutOfItsChunks) {
  // A [2, 2, 2] stacked tensor in two chunks cut on the last axis (DCP chunks: local offsets 0).
  std::vector<SourceShard> chunks;
  for (int c = 0; c < 2; ++c) {
    chunks.push_back(Piece({2, 2, 1}, 10.0f * c, {Placement{Box{{0, 0, c}, {2, 2, 1}}, {0, 0, 0}}}));
  }
  EXPECT_EQ(Elements(JoinRuns(chunks, {2, 2, 2}, 4, 1)), (std::vector<float>{2, 12, 3, 13}));
  const SourceShard layer0 = JoinRuns(chunks, {2, 2, 2}, 4, 0);
  EXPECT_EQ(layer0.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Elements(layer0), (std::vector<float>{0, 10, 1, 11}));
}

TEST(JoinRunsTest, AnExpertOfALayerIsSlicedOutOfItsChunks) {
  // A [2, 2, 2] tensor stacking 2 layers of 2 experts, one chunk per (layer, expert) as SequentialMLP
  // saves them, in two files (expert parallelism), their chunks in file order, not element order.
  std::vector<SourceShard> chunks;
  for (int e : {1, 0}) {
    for (int l = 0; l < 2; ++l) {
      chunks.push_back(Piece({1, 1, 2}, 10.0f * l + 100.0f * e, {Placement{Box{{l, e, 0}, {1, 1, 2}}, {0, 0, 0}}}));
    }
  }
  const SourceShard expert = JoinRuns(chunks, {2, 2, 2}, 4, std::vector<int64_t>{1, 0});
  EXPECT_EQ(expert.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(Elements(expert), (std::vector<float>{10, 11}));
  EXPECT_EQ(Elements(JoinRuns(chunks, {2, 2, 2}, 4, std::vector<int64_t>{0, 1})), (std::vector<float>{100, 101}));
  EXPECT_EQ(Elements(JoinRuns(chunks, {2, 2, 2}, 4, std::vector<int64_t>{})),
            (std::vector<float>{0, 1, 100, 101, 10, 11, 110, 111}));
}

}  // namespace
}  // namespace reshard
