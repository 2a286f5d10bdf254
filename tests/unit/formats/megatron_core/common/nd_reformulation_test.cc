#include "formats/megatron_core/common/nd_reformulation.h"

#include <gtest/gtest.h>

#include <set>

#include "util/shape.h"

namespace reshard {
namespace {

NdReformulation Read(const std::vector<int64_t>& saved, const std::vector<int64_t>& original) {
  Result<NdReformulation> r = ReadNdReformulation(saved, original, "optimizer.state.exp_avg.w");
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : NdReformulation{};
}

Box At(std::vector<int64_t> offsets, std::vector<int64_t> sizes) { return Box{std::move(offsets), std::move(sizes)}; }

// Every fragment once, together the whole tensor: the boxes tile it.
void ExpectTiles(const NdReformulation& r, const std::vector<int64_t>& original) {
  std::set<std::vector<int64_t>> starts;
  int64_t covered = 0;
  for (int64_t j = 0; j < r.fragments(); ++j) {
    const Box box = r.FragmentBox(j);
    EXPECT_EQ(box.numel(), r.fragment_numel());
    for (int d = 0; d < box.rank(); ++d) EXPECT_LE(box.end(d), original[d]);
    starts.insert(box.offsets);
    covered += box.numel();
  }
  EXPECT_EQ(starts.size(), static_cast<size_t>(r.fragments()));
  EXPECT_EQ(covered, ShapeNumel(original));
}

// The sample's QKV, (layers 2, 32 rows, hidden 16) at TP 2: saved (2, 2, 1, 256),
// fragments layer-major, then TP rank.
TEST(NdReformulationTest, ColumnParallelLayerStackedKey) {
  const NdReformulation r = Read({2, 2, 1, 256}, {2, 32, 16});
  EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(r.fragment, (std::vector<int64_t>{1, 16, 16}));
  EXPECT_EQ(r.fragments(), 4);
  EXPECT_EQ(r.fragment_numel(), 256);
  EXPECT_EQ(r.FragmentBox(0), At({0, 0, 0}, {1, 16, 16}));
  EXPECT_EQ(r.FragmentBox(1), At({0, 16, 0}, {1, 16, 16}));
  EXPECT_EQ(r.FragmentBox(2), At({1, 0, 0}, {1, 16, 16}));
  EXPECT_EQ(r.FragmentBox(3), At({1, 16, 0}, {1, 16, 16}));
  ExpectTiles(r, {2, 32, 16});
}

// A row-parallel linear_fc2 (2, 16, 32) cuts its last axis.
TEST(NdReformulationTest, RowParallelCutsTheLastAxis) {
  const NdReformulation r = Read({2, 1, 2, 256}, {2, 16, 32});
  EXPECT_EQ(r.FragmentBox(1), At({0, 0, 16}, {1, 16, 16}));
  EXPECT_EQ(r.FragmentBox(2), At({1, 0, 0}, {1, 16, 16}));
  ExpectTiles(r, {2, 16, 32});
}

// SwiGLU's linear_fc1 [all gate; all up] at TP 4: 8 fragments on the row
// axis, TP rank r's gate at r and its up at 4 + r.
TEST(NdReformulationTest, SwigluFc1HasTwoFragmentsPerTpRank) {
  const NdReformulation r = Read({3, 8, 1, 40}, {3, 64, 5});
  EXPECT_EQ(r.FragmentBox(5), At({0, 40, 0}, {1, 8, 5}));
  EXPECT_EQ(r.FragmentBox(8 + 1), At({1, 8, 0}, {1, 8, 5}));
  ExpectTiles(r, {3, 64, 5});
}

// A vocabulary-parallel embedding (no layer axis), a replicated 1-D norm
// and a 0-d tensor.
TEST(NdReformulationTest, UnstackedReplicatedAndScalar) {
  EXPECT_EQ(Read({4, 1, 160}, {64, 10}).FragmentBox(3), At({48, 0}, {16, 10}));
  const NdReformulation norm = Read({1, 16}, {16});
  EXPECT_EQ(norm.fragments(), 1);
  EXPECT_EQ(norm.FragmentBox(0), At({0}, {16}));
  const NdReformulation scalar = Read({1}, {});
  EXPECT_EQ(scalar.fragments(), 1);
  EXPECT_EQ(scalar.fragment_numel(), 1);
}

TEST(NdReformulationTest, ShapesThatReformulateNothingAreOneLineErrors) {
  const std::vector<int64_t> qkv = {2, 32, 16};
  for (const std::vector<int64_t>& saved : std::vector<std::vector<int64_t>>{
           {2, 2, 256},          // one axis short
           {2, 2, 1, 1, 256},    // one axis too many
           {2, 3, 1, 160},       // 3 does not divide 32
           {2, 0, 1, 256},       // no fragments
           {2, -2, 1, 256},      // negative
           {2, 2, 1, 255},       // not the fragments' numel
           {2, 2, 1, 512},       // the original numel per layer, not per fragment
           {},                   // nothing
       }) {
    Result<NdReformulation> r = ReadNdReformulation(saved, qkv, "optimizer.state.fp32_param.qkv");
    ASSERT_FALSE(r.ok()) << ShapeNumel(saved);
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
    EXPECT_NE(r.status().message().find("optimizer.state.fp32_param.qkv"), std::string::npos);
    EXPECT_NE(r.status().message().find("[2, 32, 16]"), std::string::npos);
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  }
  // An original shape whose numel overflows is no shape a tensor has.
  const int64_t huge = int64_t{1} << 40;
  EXPECT_FALSE(ReadNdReformulation({1, 1, 1}, {huge, huge}, "x").ok());
}

// The writer's side: a rank's piece gives the reading's counts back, and
// each fragment box its row of the saved tensor.
TEST(NdReformulationTest, PiecesGiveTheSavedShapeAndRows) {
  Result<NdReformulation> r = NdReformulationOf({2, 32, 16}, {1, 16, 16}, "optimizer.state.exp_avg.w");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->saved_shape(), (std::vector<int64_t>{2, 2, 1, 256}));
  const NdReformulation read = Read(r->saved_shape(), {2, 32, 16});
  EXPECT_EQ(read.counts, r->counts);
  for (int64_t j = 0; j < r->fragments(); ++j) {
    const std::vector<int64_t> row = r->FragmentIndex(r->FragmentBox(j));
    int64_t again = 0;
    for (size_t d = 0; d < row.size(); ++d) again = again * r->counts[d] + row[d];
    EXPECT_EQ(again, j);
  }
  EXPECT_EQ(r->FragmentIndex(At({1, 16, 0}, {1, 16, 16})), (std::vector<int64_t>{1, 1, 0}));
  // A replicated norm of two layers: one fragment per layer.
  r = NdReformulationOf({2, 16}, {1, 16}, "n");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->saved_shape(), (std::vector<int64_t>{2, 1, 16}));
}

TEST(NdReformulationTest, UnevenPiecesAreRefused) {
  for (const std::vector<int64_t>& piece : std::vector<std::vector<int64_t>>{{1, 12, 16}, {1, 16}, {0, 16, 16}}) {
    const Result<NdReformulation> r = NdReformulationOf({2, 32, 16}, piece, "optimizer.state.exp_avg.w");
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
    EXPECT_NE(r.status().message().find("optimizer.state.exp_avg.w: pieces of shape"), std::string::npos);
  }
}

}  // namespace
}  // namespace reshard
