// The HF export's tensor transforms: which rows split_qkv and split_halves
// take, the gathers and transposes that stream them, and the mapping of
// canonical tensors to HF tensors.
#include "formats/hf_common/hf_tensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <thread>

#include "formats/hf_common/hf_rules.h"
#include "pickle/value.h"
#include "test_util.h"

namespace reshard {
namespace {

// Bytes 0, 1, 2, ... of a tensor, produced from memory.
ByteProducer Counting(int64_t n) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(n);
  std::iota(bytes->begin(), bytes->end(), 0);
  return [bytes](int64_t offset, int64_t length, uint8_t* dst) {
    std::memcpy(dst, bytes->data() + offset, length);
    return Status::Ok();
  };
}

std::vector<uint8_t> Read(const ByteProducer& p, int64_t offset, int64_t length) {
  std::vector<uint8_t> out(length);
  EXPECT_TRUE(p(offset, length, out.data()).ok());
  return out;
}

TEST(QkvRows, MultiHeadIsPerHeadQkv) {
  // [heads 2, 3, head_dim 3]: head 0's q, k, v, then head 1's.
  EXPECT_EQ(QkvRows(2, 2, 3, 0), (std::vector<RowRun>{{0, 3}, {9, 3}}));
  EXPECT_EQ(QkvRows(2, 2, 3, 1), (std::vector<RowRun>{{3, 3}, {12, 3}}));
  EXPECT_EQ(QkvRows(2, 2, 3, 2), (std::vector<RowRun>{{6, 3}, {15, 3}}));
}

TEST(QkvRows, GroupedIsQueriesThenKeyThenValuePerGroup) {
  // [groups 2, 4/2 + 2, head_dim 1]: q q k v | q q k v.
  EXPECT_EQ(QkvRows(2, 4, 1, 0), (std::vector<RowRun>{{0, 2}, {4, 2}}));
  EXPECT_EQ(QkvRows(2, 4, 1, 1), (std::vector<RowRun>{{2, 1}, {6, 1}}));
  EXPECT_EQ(QkvRows(2, 4, 1, 2), (std::vector<RowRun>{{3, 1}, {7, 1}}));
}

TEST(HfNameTemplate, MatchesAndMakesTheNamesOfABlockAndAnExpert) {
  const HfNameTemplate t("model.layers.{block}.mlp.experts.{expert}.w1.weight");
  std::string block, expert;
  ASSERT_TRUE(t.Match("model.layers.12.mlp.experts.7.w1.weight", &block, &expert));
  EXPECT_EQ(block, "12");
  EXPECT_EQ(expert, "7");
  EXPECT_EQ(t.With("3", "0"), "model.layers.3.mlp.experts.0.w1.weight");
  EXPECT_FALSE(t.Match("model.layers.12.mlp.experts.x.w1.weight", &block, &expert));
  EXPECT_FALSE(t.Match("model.layers.12.mlp.experts.7.w3.weight", &block, &expert));
  // Without {expert}: only the block, whose value a caller that asks for no expert gets alone.
  const HfNameTemplate dense("model.layers.{block}.mlp.up_proj.weight");
  ASSERT_TRUE(dense.Match("model.layers.4.mlp.up_proj.weight", &block, &expert));
  EXPECT_EQ(block, "4");
  EXPECT_EQ(expert, "");
  ASSERT_TRUE(t.Match("model.layers.1.mlp.experts.2.w1.weight", &block));
  EXPECT_EQ(block, "1");
  // No placeholder: the name itself.
  ASSERT_TRUE(HfNameTemplate("lm_head.weight").Match("lm_head.weight", &block, &expert));
  EXPECT_EQ(block, "");
}

TEST(HalfRows, FirstAndSecond) {
  EXPECT_EQ(HalfRows(6, 0), (std::vector<RowRun>{{0, 3}}));
  EXPECT_EQ(HalfRows(6, 1), (std::vector<RowRun>{{3, 3}}));
}

TEST(GatherRows, AnyRangeOfTheGatheredRows) {
  const ByteProducer rows = GatherRows(Counting(6), 2, {{2, 1}, {0, 2}});  // rows of 2 bytes: 2, then 0-1
  EXPECT_EQ(Read(rows, 0, 6), (std::vector<uint8_t>{4, 5, 0, 1, 2, 3}));
  EXPECT_EQ(Read(rows, 1, 3), (std::vector<uint8_t>{5, 0, 1}));
}

TEST(Transposed, ColumnsBecomeRowsInEveryRange) {
  const ByteProducer t = Transposed(Counting(6), 2, 3, 1, nullptr);  // [[0 1 2] [3 4 5]]
  EXPECT_EQ(Read(t, 0, 4), (std::vector<uint8_t>{0, 3, 1, 4}));
  EXPECT_EQ(Read(t, 4, 2), (std::vector<uint8_t>{2, 5}));
  EXPECT_EQ(Read(t, 1, 4), (std::vector<uint8_t>{3, 1, 4, 2}));  // any range, again
}

TEST(Transposed, WholeElements) {
  const ByteProducer t = Transposed(Counting(8), 2, 2, 2, nullptr);  // 2-byte elements [[a b] [c d]]
  EXPECT_EQ(Read(t, 0, 8), (std::vector<uint8_t>{0, 1, 4, 5, 2, 3, 6, 7}));
}

// A scratch folder named as a run's jobs name theirs.
struct Scratch {
  Scratch() : folder(std::make_shared<ScratchFolder>()) { folder->Use(dir.path().string()); }
  int64_t Entries() const {
    return std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator());
  }
  TempDir dir;
  std::shared_ptr<ScratchFolder> folder;
};

TEST(Transposed, TwoThreadsMayProduceRangesAtOnce) {
  constexpr int64_t kRows = 64, kCols = 96, kBytes = kRows * kCols;  // 1-byte elements
  std::vector<uint8_t> want(kBytes);
  for (int64_t c = 0; c < kCols; ++c) {
    for (int64_t r = 0; r < kRows; ++r) want[c * kRows + r] = static_cast<uint8_t>(r * kCols + c);
  }
  const Scratch scratch;
  for (int pass = 0; pass < 50; ++pass) {  // each pass a new producer, as each export makes one
    const ByteProducer t = Transposed(Counting(kBytes), kRows, kCols, 1, scratch.folder, 1000);
    std::vector<uint8_t> got(kBytes);
    auto half = [&](int64_t begin) {
      for (int64_t at = begin; at < begin + kBytes / 2; at += 512) EXPECT_TRUE(t(at, 512, got.data() + at).ok());
    };
    std::thread other(half, kBytes / 2);
    half(0);
    other.join();
    ASSERT_EQ(got, want) << "pass " << pass;
  }
}

// A [rows, cols] matrix of `element`-byte elements whose bytes are all
// different (as far as 4 bytes tell), produced from memory; *requests, when
// given, learns the length of every request.
struct Matrix {
  Matrix(int64_t rows, int64_t cols, int element) : rows(rows), cols(cols), element(element) {
    bytes = std::make_shared<std::vector<uint8_t>>(rows * cols * element);
    for (size_t i = 0; i < bytes->size(); ++i) (*bytes)[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  }

  ByteProducer Producer(std::vector<int64_t>* requests = nullptr) const {
    return [bytes = bytes, requests](int64_t offset, int64_t length, uint8_t* dst) {
      if (requests != nullptr) requests->push_back(length);
      std::memcpy(dst, bytes->data() + offset, length);
      return Status::Ok();
    };
  }

  // The transpose, element by element.
  std::vector<uint8_t> Naive() const {
    std::vector<uint8_t> out(bytes->size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(out.data() + (c * rows + r) * element, bytes->data() + (r * cols + c) * element, element);
      }
    }
    return out;
  }

  int64_t rows, cols;
  int element;
  std::shared_ptr<std::vector<uint8_t>> bytes;
};

// All of `t` in ranges of `step` elements (the last one shorter).
std::vector<uint8_t> ReadAll(const ByteProducer& t, const Matrix& m, int64_t step) {
  std::vector<uint8_t> got(m.bytes->size());
  for (int64_t at = 0; at < static_cast<int64_t>(got.size()); at += step * m.element) {
    const int64_t n = std::min<int64_t>(step * m.element, got.size() - at);
    EXPECT_TRUE(t(at, n, got.data() + at).ok());
  }
  return got;
}

TEST(Transposed, EqualsTheNaiveTransposeForEveryElementSizeAndPiece) {
  // Odd shapes; pieces from one element (a strip of one row, a band of one
  // column) to the whole matrix (held in memory); ranges that cross rows,
  // strips and bands.
  const Scratch scratch;
  for (int element : {1, 2, 3, 4, 8}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 13}, {37, 5}, {129, 67}}) {
      const Matrix m(rows, cols, element);
      const std::vector<uint8_t> want = m.Naive();
      for (int64_t piece : {int64_t{1}, rows * element * 3, cols * element * 10 + 1, kTransposePieceBytes}) {
        SCOPED_TRACE(testing::Message() << element << "-byte [" << rows << ", " << cols << "], piece " << piece);
        EXPECT_EQ(ReadAll(Transposed(m.Producer(), rows, cols, element, scratch.folder, piece), m, 11), want);
      }
    }
  }
}

TEST(Transposed, ABigMatrixGoesThroughAnUnnamedScratchFileReadOnce) {
  // 4096 rows of 2000 bytes (8 MB) in 1 MiB pieces: the source is read
  // once, a strip of 524 rows a request, into a scratch file without a name
  // in the folder; the memory held is a band of 128 columns and its
  // reordering. Once all of it has been produced it is dropped, and made
  // again if asked for again.
  const Scratch scratch;
  const Matrix m(4096, 1000, 2);
  const std::vector<uint8_t> want = m.Naive();
  std::vector<int64_t> requests;
  const ByteProducer t = Transposed(m.Producer(&requests), m.rows, m.cols, m.element, scratch.folder, 1 << 20);
  EXPECT_EQ(Read(t, 0, 1 << 10), std::vector<uint8_t>(want.begin(), want.begin() + (1 << 10)));
  EXPECT_EQ(scratch.Entries(), 0);
  EXPECT_EQ(requests.size(), 8u);
  EXPECT_LE(*std::max_element(requests.begin(), requests.end()), 1 << 20);
  EXPECT_EQ(std::accumulate(requests.begin(), requests.end(), int64_t{0}), int64_t{4096} * 2000);
  std::vector<uint8_t> got(want.size());
  std::copy_n(want.begin(), 1 << 10, got.begin());
  for (int64_t at = 1 << 10; at < static_cast<int64_t>(got.size()); at += 1 << 20) {
    ASSERT_TRUE(t(at, std::min<int64_t>(1 << 20, got.size() - at), got.data() + at).ok());
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(requests.size(), 8u);
  EXPECT_EQ(Read(t, 0, 1 << 10), std::vector<uint8_t>(want.begin(), want.begin() + (1 << 10)));
  EXPECT_EQ(requests.size(), 16u);
  EXPECT_EQ(TransposeScratchBytes(m.rows, m.cols, m.element, 1 << 20), 2 << 20);
}

TEST(Transposed, SmallMatricesAreHeldInMemoryAndBigOnesNeedAFolder) {
  const Matrix small(16, 16, 4), big(64, 64, 4);  // 1 KiB and 16 KiB, in 4 KiB pieces
  EXPECT_EQ(TransposeScratchBytes(small.rows, small.cols, small.element, 4096), 2 * 1024);
  EXPECT_EQ(ReadAll(Transposed(small.Producer(), 16, 16, 4, std::make_shared<ScratchFolder>(), 4096), small, 7),
            small.Naive());
  const ByteProducer t = Transposed(big.Producer(), 64, 64, 4, std::make_shared<ScratchFolder>(), 4096);
  std::vector<uint8_t> out(16);
  const Status s = t(0, 16, out.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("before the run named its folder"), std::string::npos) << s.message();
}

TEST(Transposed, ColumnsLongerThanAPieceAreBandsOfOneColumn) {
  // 2^19 rows of two 4-byte elements in 1 MiB pieces: strips of 2^17 rows,
  // and each band one column of 2 MiB, held whole.
  const Scratch scratch;
  const Matrix m(1 << 19, 2, 4);
  EXPECT_EQ(TransposeScratchBytes(m.rows, m.cols, m.element, 1 << 20), 2 * (int64_t{1} << 21));
  EXPECT_EQ(ReadAll(Transposed(m.Producer(), m.rows, m.cols, m.element, scratch.folder, 1 << 20), m, 1 << 17),
            m.Naive());
}

TEST(Transposed, ScratchIsAFewPiecesWhateverTheMatrix) {
  EXPECT_EQ(TransposeScratchBytes(512, 1024, 2), int64_t{2} << 20);  // one piece: the matrix and its transpose
  for (int64_t side : {int64_t{1} << 12, int64_t{1} << 14, int64_t{1} << 16}) {
    EXPECT_LE(TransposeScratchBytes(side, side, 4), 2 * std::max(kTransposePieceBytes, side * 4));
  }
}

// A family with a fused QKV (2 groups, 4 heads) and a GLU MLP, transposed.
class MapHfTensorsTest : public ::testing::Test {
 protected:
  MapHfTensorsTest() {
    HfTensorMap qkv{1, "layers.{block}.qkv", {"h.{block}.q", "h.{block}.k", "h.{block}.v"}};
    qkv.split = HfTensorMap::Split::kQkv;
    qkv.groups = MetaRef{{"args.num_key_value_heads"}};
    qkv.heads = MetaRef{{"4"}};
    HfTensorMap fc{2, "layers.{block}.fc", {"h.{block}.gate", "h.{block}.up"}};
    fc.split = HfTensorMap::Split::kHalves;
    fc.transpose = true;
    hf_.architecture = "TinyForCausalLM";
    hf_.tensors = {qkv, fc, HfTensorMap{3, "norm", {"ln_f"}}};
    Set(metadata_, "args", Value::MakeDict());
    Set(*FindMutable(metadata_, "args"), "num_key_value_heads", Value::Int(2));
  }

  // Canonical tensors of uint8 elements, their bytes counting from 0.
  void Add(const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    chosen_.push_back({name, sources_.size(), DType::kUInt8, DType::kUInt8, shape, false});
    sources_.push_back({"weights", name, name, "", "", DType::kUInt8, shape, false, Counting(n)});
  }

  Result<std::vector<StateDictTensor>> Map() {
    return MapHfTensors(hf_, chosen_, RuleInputs{metadata_, settings_}, nullptr, &scratch_);
  }

  std::vector<uint8_t> Bytes(const StateDictTensor& t) { return Read(t.bytes(sources_), 0, t.size()); }

  HfExport hf_;
  Value metadata_ = Value::MakeDict(), settings_ = Value::MakeDict();
  std::vector<ChosenTensor> chosen_;
  std::vector<FullTensor> sources_;
  int64_t scratch_ = 0;
};

TEST_F(MapHfTensorsTest, RenamesDividesAndTransposes) {
  Add("layers.3.qkv", {8, 1});  // 2 groups x (2 q + k + v) x head_dim 1
  Add("layers.3.fc", {4, 2});   // [gate (2 rows); up (2 rows)] x 2 inputs
  Add("norm", {3});
  Result<std::vector<StateDictTensor>> out = Map();
  ASSERT_TRUE(out.ok()) << out.status().message();
  ASSERT_EQ(out->size(), 6u);
  const std::vector<std::string> names = {"h.3.q", "h.3.k", "h.3.v", "h.3.gate", "h.3.up", "ln_f"};
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ((*out)[i].name, names[i]);
  EXPECT_EQ(Bytes((*out)[0]), (std::vector<uint8_t>{0, 1, 4, 5}));
  EXPECT_EQ(Bytes((*out)[1]), (std::vector<uint8_t>{2, 6}));
  EXPECT_EQ(Bytes((*out)[2]), (std::vector<uint8_t>{3, 7}));
  EXPECT_EQ((*out)[3].shape, (std::vector<int64_t>{2, 2}));  // gate [[0 1] [2 3]] transposed
  EXPECT_EQ(Bytes((*out)[3]), (std::vector<uint8_t>{0, 2, 1, 3}));
  EXPECT_EQ(Bytes((*out)[4]), (std::vector<uint8_t>{4, 6, 5, 7}));
  EXPECT_EQ(Bytes((*out)[5]), (std::vector<uint8_t>{0, 1, 2}));
  EXPECT_EQ(scratch_, 2 * 4);  // the largest transposed tensor and its transpose, in memory
}

TEST_F(MapHfTensorsTest, OneNameKeepsQkvFusedInQkvOrder) {
  hf_.tensors[0].to = {"h.{block}.c_attn"};
  Add("layers.0.qkv", {8, 1});
  Add("layers.0.fc", {4, 2});
  Add("norm", {3});
  Result<std::vector<StateDictTensor>> out = Map();
  ASSERT_TRUE(out.ok()) << out.status().message();
  EXPECT_EQ(Bytes((*out)[0]), (std::vector<uint8_t>{0, 1, 4, 5, 2, 6, 3, 7}));
}

TEST_F(MapHfTensorsTest, RefusesWhatItCannotPlace) {
  Add("layers.0.qkv", {8, 1});
  Add("layers.0.fc", {4, 2});
  Add("layers.0.rotary", {2});
  EXPECT_NE(Map().status().message().find("has no place for layers.0.rotary"), std::string::npos);
  chosen_.pop_back();
  EXPECT_NE(Map().status().message().find("TinyForCausalLM needs norm, which this checkpoint does not have"),
            std::string::npos);
  Add("norm", {3});
  Set(*FindMutable(metadata_, "args"), "num_key_value_heads", Value::Int(3));
  EXPECT_NE(Map().status().message().find("not a fused QKV of 3 KV groups and 4 query heads"), std::string::npos);
  Set(metadata_, "args", Value::MakeDict());
  EXPECT_NE(Map().status().message().find("--set args.num_key_value_heads=N"), std::string::npos);
}

TEST_F(MapHfTensorsTest, ShapeTheArchitectureFixes) {
  hf_.tensors[1].shape = {"2*args.hidden_size", "args.hidden_size"};
  Add("layers.0.qkv", {8, 1});
  Add("layers.0.fc", {4, 2});
  Add("norm", {3});
  EXPECT_NE(Map().status().message().find("not recorded in the checkpoint metadata (args.hidden_size)"),
            std::string::npos);
  Set(*FindMutable(metadata_, "args"), "hidden_size", Value::Int(2));
  EXPECT_TRUE(Map().ok());
  Set(*FindMutable(metadata_, "args"), "hidden_size", Value::Int(3));
  EXPECT_NE(Map().status().message().find("TinyForCausalLM needs layers.0.fc of shape [6, 3] (2*args.hidden_size, "
                                          "args.hidden_size, hf.tensors line 2), and the checkpoint's is [4, 2]"),
            std::string::npos);
}

}  // namespace
}  // namespace reshard
