// A safetensors file written as ranges, in any order, is the file written
// whole, and the ranges' digests join into the whole file's.
#include "container/safetensors_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "exec/manifest.h"
#include "test_util.h"

namespace reshard {
namespace {

// Tensors whose bytes count up from `seed`, of sizes that leave later
// tensors at offsets that are not multiples of their element size.
std::vector<SafetensorsTensor> MixedTensors() {
  auto counting = [](uint8_t seed) {
    return [seed](int64_t offset, int64_t length, uint8_t* dst) {
      for (int64_t i = 0; i < length; ++i) dst[i] = static_cast<uint8_t>(seed + offset + i);
      return Status::Ok();
    };
  };
  return {{"a", DType::kBFloat16, {3, 5}, counting(1)},
          {"b", DType::kFloat32, {7, 3}, counting(50)},
          {"c", DType::kUInt8, {9}, counting(90)},
          {"d", DType::kFloat64, {2, 2}, counting(120)}};
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class SafetensorsRangeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<SafetensorsLayout> laid_out = LayOutSafetensors(tensors_, {{"format", "pt"}});
    ASSERT_TRUE(laid_out.ok()) << laid_out.status().message();
    layout_ = *laid_out;
  }

  // Writes [begin, end) of the file at `path`.
  FileDigest Write(const std::string& path, int64_t begin, int64_t end) {
    Result<FileDigest> piece = WriteSafetensorsRange(path, layout_, tensors_, begin, end, &buffer_, nullptr);
    EXPECT_TRUE(piece.ok()) << piece.status().message();
    return piece.ok() ? *piece : FileDigest{};
  }

  std::vector<SafetensorsTensor> tensors_ = MixedTensors();
  SafetensorsLayout layout_;
  std::vector<uint8_t> buffer_ = std::vector<uint8_t>(8);  // several writes per tensor
  TempDir dir_;
};

TEST_F(SafetensorsRangeTest, LayoutPlacesTensorsAfterAnAlignedHeader) {
  EXPECT_EQ(layout_.prefix.size() % 8, 0u);
  uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= static_cast<uint64_t>(static_cast<uint8_t>(layout_.prefix[i])) << (8 * i);
  EXPECT_EQ(header + 8, layout_.prefix.size());
  EXPECT_NE(layout_.prefix.find("\"b\":{\"dtype\":\"F32\",\"shape\":[7,3],\"data_offsets\":[30,114]}"),
            std::string::npos);
  EXPECT_NE(layout_.prefix.find("\"__metadata__\":{\"format\":\"pt\"}"), std::string::npos);
  ASSERT_EQ(layout_.offsets.size(), 4u);
  EXPECT_EQ(layout_.offsets[1], static_cast<int64_t>(layout_.prefix.size()) + 30);
  EXPECT_EQ(layout_.size, layout_.offsets[3] + 32);
}

TEST_F(SafetensorsRangeTest, CutsFallOnWholeElementsAndCoverTheFile) {
  const std::vector<int64_t> cuts = SafetensorsCuts(layout_, tensors_, 7);
  ASSERT_GE(cuts.size(), 3u);
  EXPECT_EQ(cuts.front(), 0);
  EXPECT_EQ(cuts.back(), layout_.size);
  for (size_t i = 1; i < cuts.size(); ++i) {
    EXPECT_LT(cuts[i - 1], cuts[i]);
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const int64_t local = cuts[i] - layout_.offsets[t];
      if (local > 0 && local < SafetensorsBytes(tensors_[t])) {
        EXPECT_EQ(local % ElementSize(tensors_[t].dtype), 0) << "cut " << cuts[i] << " in " << tensors_[t].name;
      }
    }
  }
  EXPECT_EQ(SafetensorsCuts(layout_, tensors_, int64_t{1} << 30), (std::vector<int64_t>{0, layout_.size}));
}

TEST_F(SafetensorsRangeTest, RangesWrittenInAnyOrderMakeTheWholeFile) {
  const std::string whole = (dir_.path() / "whole.safetensors").string();
  const FileDigest all = Write(whole, 0, layout_.size);
  const std::string parted = (dir_.path() / "parted.safetensors").string();
  const std::vector<int64_t> cuts = SafetensorsCuts(layout_, tensors_, 13);
  std::multimap<std::string, FileDigest> pieces;
  for (size_t i = cuts.size() - 1; i > 0; --i) pieces.emplace("f", Write(parted, cuts[i - 1], cuts[i]));

  const std::string bytes = ReadAll(whole);
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), layout_.size);
  EXPECT_EQ(ReadAll(parted), bytes);
  EXPECT_EQ(bytes.compare(0, layout_.prefix.size(), layout_.prefix), 0);
  EXPECT_EQ(static_cast<uint8_t>(bytes[layout_.offsets[1] + 5]), 55);  // b's byte 5 counts from 50
  EXPECT_EQ(all.crc32, Crc32(0, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));

  Result<std::map<std::string, FileDigest>> joined = WholeFiles(pieces);
  ASSERT_TRUE(joined.ok()) << joined.status().message();
  EXPECT_EQ(joined->at("f").bytes, all.bytes);
  EXPECT_EQ(joined->at("f").crc32, all.crc32);
}

TEST_F(SafetensorsRangeTest, ARangeThatCutsAnElementIsRefused) {
  const int64_t inside_b = layout_.offsets[1] + 2;  // half of b's first fp32
  Result<FileDigest> piece = WriteSafetensorsRange((dir_.path() / "x").string(), layout_, tensors_, 0, inside_b,
                                                   &buffer_, nullptr);
  ASSERT_FALSE(piece.ok());
  EXPECT_NE(piece.status().message().find("cuts an element of b"), std::string::npos);
}

}  // namespace
}  // namespace reshard
