#include "plan/slicing.h"

#include <gtest/gtest.h>

#include "logical/tp_placement.h"

namespace reshard {
namespace {

// Every TP rank's shard of a [full, 3] tensor split on axis 0 in `parts` parts.
std::vector<SourceShard> AllRanks(int64_t full, int parts, int tp) {
  std::vector<SourceShard> out(tp);
  for (int r = 0; r < tp; ++r) {
    out[r].shape = {full / tp, 3};
    out[r].placements = PlacementsOf(RankPieces(full, parts, tp, r), out[r].shape, 0);
  }
  return out;
}

// The global row a local row of a shard with `placements` holds (-1: none).
int64_t GlobalRow(const std::vector<Placement>& placements, int64_t local) {
  for (const Placement& p : placements) {
    if (local >= p.local[0] && local < p.local[0] + p.global.sizes[0]) {
      return p.global.offsets[0] + (local - p.local[0]);
    }
  }
  return -1;
}

// Every target index is written exactly once, from the source index holding
// the same full-tensor position.
void ExpectExactCover(int64_t full, int parts, int src_tp, int dst_tp) {
  const auto sources = AllRanks(full, parts, src_tp);
  const auto targets = AllRanks(full, parts, dst_tp);
  for (int t = 0; t < dst_tp; ++t) {
    std::vector<int> hits(full / dst_tp, 0);
    for (const BoxCopy& c : IntersectPlacements(targets[t].placements, sources, Box::Whole({full, 3}))) {
      EXPECT_EQ(c.dst.offsets[1], 0);
      EXPECT_EQ(c.dst.sizes[1], 3);
      for (int64_t i = 0; i < c.dst.sizes[0]; ++i) {
        ++hits[c.dst.offsets[0] + i];
        ASSERT_EQ(GlobalRow(targets[t].placements, c.dst.offsets[0] + i),
                  GlobalRow(sources[c.src_shard].placements, c.src_offsets[0] + i));
        ASSERT_EQ(c.src_shape, sources[c.src_shard].shape);
      }
    }
    for (int h : hits) EXPECT_EQ(h, 1);
  }
}

TEST(SlicingTest, RankPiecesStackEveryPart) {
  // SwiGLU [gate; up] with 8 rows per part on 2 ranks: rank 1 holds gate rows
  // 4-7 then up rows 12-15.
  const auto pieces = RankPieces(16, 2, 2, 1);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].full_start, 4);
  EXPECT_EQ(pieces[0].local_start, 0);
  EXPECT_EQ(pieces[1].full_start, 12);
  EXPECT_EQ(pieces[1].local_start, 4);
  const auto placements = PlacementsOf(pieces, {8, 5}, 0);
  EXPECT_EQ(placements[1].global, (Box{{12, 0}, {4, 5}}));
  EXPECT_EQ(placements[1].local, (std::vector<int64_t>{4, 0}));
}

TEST(SlicingTest, ExactCoverForExpansionShrinkingAndNonDivisors) {
  ExpectExactCover(24, 1, 2, 3);
  ExpectExactCover(24, 1, 3, 2);
  ExpectExactCover(24, 2, 2, 4);
  ExpectExactCover(24, 2, 4, 1);
  ExpectExactCover(36, 3, 2, 3);
  ExpectExactCover(48, 2, 3, 4);
}

TEST(SlicingTest, VocabularyRowsBeyondTheSourceAreFilled) {
  // 112 source rows on 2 ranks, 128 target rows on 4 ranks: rank 3 holds rows
  // 96-127, of which 112-127 are new.
  const auto target = PlacementsOf(RankPieces(128, 1, 4, 3), {32, 3}, 0);
  const Box source = Box::Whole({112, 3});
  const auto copies = IntersectPlacements(target, AllRanks(112, 1, 2), source);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src_shard, 1);
  EXPECT_EQ(copies[0].src_offsets, (std::vector<int64_t>{40, 0}));
  EXPECT_EQ(copies[0].dst, (Box{{0, 0}, {16, 3}}));
  const auto fills = FillsOutside(target, source, -1.0);
  ASSERT_EQ(fills.size(), 1u);
  EXPECT_EQ(fills[0].dst, (Box{{16, 0}, {16, 3}}));
  EXPECT_EQ(fills[0].value, -1.0);
}

TEST(SlicingTest, ShrinkingVocabularyDropsTailPadding) {
  // 128 rows at TP 4 -> 112 at TP 2: rank 1 takes rows 56-111 only.
  const auto target = PlacementsOf(RankPieces(112, 1, 2, 1), {56, 3}, 0);
  int64_t copied = 0;
  for (const BoxCopy& c : IntersectPlacements(target, AllRanks(128, 1, 4), Box::Whole({128, 3}))) {
    copied += c.dst.sizes[0];
  }
  EXPECT_EQ(copied, 56);
  EXPECT_TRUE(FillsOutside(target, Box::Whole({128, 3}), 0).empty());
}

// Chunks cut on both axes (FSDP rows of TP columns) re-cut to other chunks:
// every target element comes once from the chunk holding it, and what no
// source holds (outside its 6 x 6) is filled, in disjoint boxes.
TEST(SlicingTest, TwoAxisChunksIntersect) {
  std::vector<SourceShard> sources;
  for (int64_t r = 0; r < 6; r += 3) {
    for (int64_t c = 0; c < 6; c += 2) {
      sources.emplace_back();
      sources.back().shape = {3, 2};
      sources.back().placements = {Placement{Box{{r, c}, {3, 2}}, {0, 0}}};
    }
  }
  // Target: rows 2-7, columns 1-7 of an 8 x 8 global tensor.
  const std::vector<Placement> target = {Placement{Box{{2, 1}, {6, 7}}, {0, 0}}};
  const Box available = Box::Whole({6, 6});
  std::vector<int> hits(6 * 7, 0);
  for (const BoxCopy& c : IntersectPlacements(target, sources, available)) {
    const Placement& s = sources[c.src_shard].placements[0];
    for (int64_t i = 0; i < c.dst.sizes[0]; ++i) {
      for (int64_t j = 0; j < c.dst.sizes[1]; ++j) {
        ++hits[(c.dst.offsets[0] + i) * 7 + c.dst.offsets[1] + j];
        EXPECT_EQ(c.dst.offsets[0] + i + 2, s.global.offsets[0] + c.src_offsets[0] + i);
        EXPECT_EQ(c.dst.offsets[1] + j + 1, s.global.offsets[1] + c.src_offsets[1] + j);
      }
    }
  }
  for (const BoxFill& f : FillsOutside(target, available, 0)) {
    for (int64_t i = 0; i < f.dst.sizes[0]; ++i) {
      for (int64_t j = 0; j < f.dst.sizes[1]; ++j) ++hits[(f.dst.offsets[0] + i) * 7 + f.dst.offsets[1] + j];
    }
  }
  for (int h : hits) EXPECT_EQ(h, 1);
}

}  // namespace
}  // namespace reshard
