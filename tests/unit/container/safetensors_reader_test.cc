// Reading safetensors files: what the writer wrote comes back tensor by
// tensor, and a header that does not describe its file is refused before
// any tensor is handed out.
#include "container/safetensors_reader.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>

#include "container/safetensors_writer.h"
#include "logical/source_shard.h"
#include "test_util.h"

namespace reshard {
namespace {

// A file of an 8-byte length, `header` and `data`.
std::string WriteRaw(const TempDir& dir, const std::string& header, const std::string& data) {
  const std::string path = (dir.path() / "t.safetensors").string();
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << data;
  return path;
}

std::string Refusal(const std::string& header, const std::string& data = std::string(16, '\0')) {
  TempDir dir;
  Result<SafetensorsFile> file = ReadSafetensors(WriteRaw(dir, header, data));
  EXPECT_FALSE(file.ok()) << header;
  return file.ok() ? "" : file.status().message();
}

TEST(SafetensorsReaderTest, ReadsWhatTheWriterWrote) {
  TempDir dir;
  const std::string path = (dir.path() / "w.safetensors").string();
  auto counting = [](uint8_t seed) {
    return [seed](int64_t offset, int64_t length, uint8_t* dst) {
      for (int64_t i = 0; i < length; ++i) dst[i] = static_cast<uint8_t>(seed + offset + i);
      return Status::Ok();
    };
  };
  std::vector<SafetensorsTensor> tensors = {{"b.weight", DType::kBFloat16, {3, 5}, counting(1)},
                                            {"a.bias", DType::kFloat32, {7}, counting(50)},
                                            {"empty", DType::kInt64, {0, 4}, counting(0)}};
  Result<SafetensorsLayout> layout = LayOutSafetensors(tensors, {{"format", "pt"}});
  ASSERT_TRUE(layout.ok());
  std::vector<uint8_t> buffer(64);
  ASSERT_TRUE(WriteSafetensorsRange(path, *layout, tensors, 0, layout->size, &buffer, nullptr).ok());

  Result<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(Find(file->metadata, "format")->as_string(), "pt");
  ASSERT_EQ(file->tensors.size(), 3u);
  for (size_t i = 0; i < 2; ++i) {  // in file order
    const auto& [name, value] = file->tensors[i];
    EXPECT_EQ(name, tensors[i].name);
    const Tensor& t = value.as_tensor();
    EXPECT_EQ(t.storage->dtype, tensors[i].dtype);
    EXPECT_EQ(t.sizes, tensors[i].shape);
    std::vector<uint8_t> want(static_cast<size_t>(SafetensorsBytes(tensors[i])));
    ASSERT_TRUE(tensors[i].produce(0, static_cast<int64_t>(want.size()), want.data()).ok());
    EXPECT_EQ(std::memcmp(TensorData(t), want.data(), want.size()), 0) << name;
  }
  EXPECT_EQ(file->tensors[2].second.as_tensor().numel(), 0);
}

TEST(SafetensorsReaderTest, RefusesHeadersThatDoNotDescribeTheFile) {
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}})").find(
                "holds 12 bytes, but its shape and dtype need 8"), std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})").find(
                "outside the file's 16 data bytes"), std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})").find("outside"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})").find(
                "dtype C64, which reshard does not read"), std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})").find("impossible shape"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 4]}})")
                .find("impossible shape"), std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})").find("not a list"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32", "shape": [2]}})").find("lacks dtype, shape or data_offsets"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                    R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})").find("share bytes"),
            std::string::npos);
  EXPECT_NE(Refusal(R"([1, 2])").find("not a JSON object"), std::string::npos);
  EXPECT_NE(Refusal(R"({"w": )").find("not valid JSON"), std::string::npos);
}

TEST(SafetensorsReaderTest, EmptyTensorsShareNoBytes) {
  TempDir dir;
  Result<SafetensorsFile> file = ReadSafetensors(WriteRaw(
      dir, R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
      std::string(16, '\0')));
  EXPECT_TRUE(file.ok()) << file.status().message();
}

TEST(SafetensorsReaderTest, RefusesALengthBeyondTheFile) {
  TempDir dir;
  const std::string path = (dir.path() / "short.safetensors").string();
  std::ofstream(path, std::ios::binary) << std::string("\xff\xff\xff\xff\0\0\0\0{}", 10);
  Result<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find("is not a safetensors file"), std::string::npos);
}

}  // namespace
}  // namespace reshard
