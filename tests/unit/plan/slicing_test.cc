#include "plan/slicing.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

std::vector<std::vector<Piece>> AllRanks(int64_t full, int parts, int tp) {
  std::vector<std::vector<Piece>> out;
  for (int r = 0; r < tp; ++r) out.push_back(RankPieces(full, parts, tp, r));
  return out;
}

// Every target index is written exactly once, from the source index holding
// the same full-tensor position.
void ExpectExactCover(int64_t full, int parts, int src_tp, int dst_tp) {
  const auto sources = AllRanks(full, parts, src_tp);
  for (int t = 0; t < dst_tp; ++t) {
    const auto target = RankPieces(full, parts, dst_tp, t);
    std::vector<int> hits(full / dst_tp, 0);
    for (const SliceCopy& c : IntersectPieces(target, sources, 0, full)) {
      for (int64_t i = 0; i < c.length; ++i) {
        ++hits[c.dst_start + i];
        // Map both sides back to full-tensor positions.
        int64_t dst_full = -1, src_full = -1;
        for (const Piece& p : target) {
          if (c.dst_start + i >= p.local_start && c.dst_start + i < p.local_start + p.length) {
            dst_full = p.full_start + (c.dst_start + i - p.local_start);
          }
        }
        for (const Piece& p : sources[c.src_shard]) {
          if (c.src_start + i >= p.local_start && c.src_start + i < p.local_start + p.length) {
            src_full = p.full_start + (c.src_start + i - p.local_start);
          }
        }
        ASSERT_EQ(dst_full, src_full);
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
  const auto target = RankPieces(128, 1, 4, 3);
  const auto copies = IntersectPieces(target, AllRanks(112, 1, 2), 0, 112);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src_shard, 1);
  EXPECT_EQ(copies[0].src_start, 40);
  EXPECT_EQ(copies[0].length, 16);
  const auto fills = FillsBeyond(target, 0, 112, -1.0);
  ASSERT_EQ(fills.size(), 1u);
  EXPECT_EQ(fills[0].dst_start, 16);
  EXPECT_EQ(fills[0].length, 16);
  EXPECT_EQ(fills[0].value, -1.0);
}

TEST(SlicingTest, ShrinkingVocabularyDropsTailPadding) {
  // 128 rows at TP 4 -> 112 at TP 2: rank 1 takes rows 56-111 only.
  const auto target = RankPieces(112, 1, 2, 1);
  int64_t copied = 0;
  for (const SliceCopy& c : IntersectPieces(target, AllRanks(128, 1, 4), 0, 112)) copied += c.length;
  EXPECT_EQ(copied, 56);
  EXPECT_TRUE(FillsBeyond(target, 0, 128, 0).empty());
}

}  // namespace
}  // namespace reshard
