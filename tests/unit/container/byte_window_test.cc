// Containers inside a byte window of a larger file, as a Distributed
// Checkpoint `.distcp` file holds one torch.save archive per item: each reads
// as the same file alone, its storages bound inside the larger file, and
// nothing outside its window is taken for part of it.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "container/safetensors_reader.h"
#include "container/safetensors_writer.h"
#include "container/torch_file.h"
#include "logical/source_shard.h"
#include "test_util.h"

namespace reshard {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

Value FloatTensor(const std::vector<float>& values) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(values.size() * 4);
  std::memcpy(bytes->data(), values.data(), bytes->size());
  auto storage = std::make_shared<Storage>();
  storage->dtype = DType::kFloat32;
  storage->numel = static_cast<int64_t>(values.size());
  storage->bytes = ByteView{bytes, bytes->data(), bytes->size()};
  Tensor t;
  t.storage = storage;
  t.sizes = {static_cast<int64_t>(values.size())};
  t.strides = Tensor::ContiguousStrides(t.sizes);
  return Value::MakeTensor(std::move(t));
}

// The bytes of a torch.save file of {"w": values}.
std::string TorchBytes(const TempDir& dir, const std::string& name, const std::vector<float>& values) {
  const std::string path = (dir.path() / name).string();
  EXPECT_TRUE(WriteTorchFile(path, MakeOrderedDict({{Value::String("w"), FloatTensor(values)}})).ok());
  return ReadAll(path);
}

// The bytes of a safetensors file of one float tensor "s" of 1, 2, 3.
std::string SafetensorsBytes(const TempDir& dir) {
  const std::string path = (dir.path() / "s.safetensors").string();
  const float values[3] = {1, 2, 3};
  std::vector<SafetensorsTensor> tensors = {
      {"s", DType::kFloat32, {3}, [&values](int64_t offset, int64_t length, uint8_t* dst) {
         std::memcpy(dst, reinterpret_cast<const uint8_t*>(values) + offset, length);
         return Status::Ok();
       }}};
  Result<SafetensorsLayout> layout = LayOutSafetensors(tensors, {});
  EXPECT_TRUE(layout.ok());
  std::vector<uint8_t> buffer(64);
  EXPECT_TRUE(WriteSafetensorsRange(path, *layout, tensors, 0, layout->size, &buffer, nullptr).ok());
  return ReadAll(path);
}

std::vector<float> Floats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  std::memcpy(out.data(), TensorData(t), out.size() * 4);
  return out;
}

// junk, archive a, archive b, a safetensors file, junk: one file, like a .distcp.
class ByteWindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string a = TorchBytes(dir_, "a.pt", {1.5, 2.5});
    const std::string b = TorchBytes(dir_, "b.pt", {-1, -2, -3});
    const std::string s = SafetensorsBytes(dir_);
    const std::string all = std::string(13, 'x') + a + b + s + std::string(7, 'y');
    a_ = {13, a.size()};
    b_ = {13 + a.size(), b.size()};
    s_ = {13 + a.size() + b.size(), s.size()};
    const std::string path = (dir_.path() / "__0_0.distcp").string();
    std::ofstream(path, std::ios::binary) << all;
    auto file = MappedFile::Open(path);
    ASSERT_TRUE(file.ok());
    file_ = *file;
  }

  TempDir dir_;
  std::shared_ptr<const MappedFile> file_;
  FileWindow a_, b_, s_;
};

TEST_F(ByteWindowTest, EachArchiveReadsAsItsOwnFile) {
  Result<Value> a = ReadTorchArchive(file_, a_);
  ASSERT_TRUE(a.ok()) << a.status().message();
  Result<Value> b = ReadTorchArchive(file_, b_);
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(Floats(Find(*a, "w")->as_tensor()), (std::vector<float>{1.5, 2.5}));
  EXPECT_EQ(Floats(Find(*b, "w")->as_tensor()), (std::vector<float>{-1, -2, -3}));
  // Bound inside the larger file's mapping, within the archive's window.
  const uint8_t* data = TensorData(Find(*b, "w")->as_tensor());
  EXPECT_GE(data, file_->data() + b_.offset);
  EXPECT_LE(data + 12, file_->data() + b_.offset + b_.size);
}

TEST_F(ByteWindowTest, SafetensorsReadsInsideItsWindow) {
  Result<SafetensorsFile> s = ReadSafetensors(file_, s_);
  ASSERT_TRUE(s.ok()) << s.status().message();
  ASSERT_EQ(s->tensors.size(), 1u);
  EXPECT_EQ(Floats(s->tensors[0].second.as_tensor()), (std::vector<float>{1, 2, 3}));
}

TEST_F(ByteWindowTest, AWindowThatCutsAnArchiveIsRefusedNamingIt) {
  // The end record is outside the window: the archive is incomplete there,
  // although the bytes after it in the file would complete it.
  Result<Value> cut = ReadTorchArchive(file_, FileWindow{a_.offset, a_.size - 1});
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("[bytes 13-"), std::string::npos) << cut.status().message();
  EXPECT_NE(cut.status().message().find("no zip end record"), std::string::npos) << cut.status().message();
  // A window that starts inside an archive is not one.
  Result<Value> inside = ReadTorchArchive(file_, FileWindow{a_.offset + 1, a_.size - 1});
  ASSERT_FALSE(inside.ok());
  EXPECT_NE(inside.status().message().find("is not a torch.save zip file"), std::string::npos);
  Result<SafetensorsFile> s = ReadSafetensors(file_, FileWindow{s_.offset, s_.size - 4});
  EXPECT_FALSE(s.ok());
}

TEST_F(ByteWindowTest, AWindowPastTheFileIsRefused) {
  for (FileWindow w : {FileWindow{file_->size() - 2, 3}, FileWindow{~uint64_t{0}, 2},
                       FileWindow{4, ~uint64_t{0}}}) {
    Result<Value> r = ReadTorchArchive(file_, w);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("run past the file's end"), std::string::npos)
        << r.status().message();
    EXPECT_FALSE(ReadSafetensors(file_, w).ok());
  }
}

}  // namespace
}  // namespace reshard
