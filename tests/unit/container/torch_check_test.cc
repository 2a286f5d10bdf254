#include "container/torch_check.h"

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "container/mapped_file.h"
#include "container/torch_file.h"
#include "container/zip_directory.h"
#include "test_util.h"

namespace reshard {
namespace {

// {"w": 1000 uint8 of a pattern, "b": 3 float32}.
Value TestRoot() {
  auto tensor = [](DType dtype, std::vector<uint8_t> bytes) {
    auto buffer = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
    auto storage = std::make_shared<Storage>();
    storage->dtype = dtype;
    storage->numel = static_cast<int64_t>(buffer->size()) / ElementSize(dtype);
    storage->bytes = ByteView{buffer, buffer->data(), buffer->size()};
    Tensor t;
    t.storage = storage;
    t.sizes = {storage->numel};
    t.strides = Tensor::ContiguousStrides(t.sizes);
    return Value::MakeTensor(std::move(t));
  };
  std::vector<uint8_t> pattern(1000);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 7);
  std::vector<uint8_t> floats(12);
  for (int i = 0; i < 3; ++i) StoreFromDouble(DType::kFloat32, i + 0.5, &floats[4 * i]);
  return MakeOrderedDict({{Value::String("w"), tensor(DType::kUInt8, pattern)},
                          {Value::String("b"), tensor(DType::kFloat32, floats)}});
}

// Record `name` as ZipDirectory finds it: its offset in the file and bytes.
struct FoundRecord {
  uint64_t offset = 0;
  std::string bytes = "(no such record)";
};
FoundRecord Record(const std::string& path, const std::string& name) {
  Result<std::shared_ptr<const MappedFile>> file = MappedFile::Open(path);
  EXPECT_TRUE(file.ok());
  Result<ZipDirectory> zip = ZipDirectory::Read(**file);
  EXPECT_TRUE(zip.ok()) << zip.status().message();
  const ZipRecord* record = zip->Find(name);
  if (record == nullptr) return {};
  const char* data = reinterpret_cast<const char*>((*file)->data() + record->data_offset);
  return {record->data_offset, std::string(data, record->size)};
}

// What torch.load reads with finds the records reshard writes, and the same
// bytes in each as reshard's own reader.
TEST(TorchCheckTest, PyTorchStreamReaderReadsWhatReshardWrites) {
  TempDir dir;
  const std::string path = (dir.path() / "layer_01-model_00-model_states.pt").string();
  ASSERT_TRUE(WriteTorchFile(path, TestRoot()).ok());
  caffe2::serialize::PyTorchStreamReader reader(path);
  std::vector<std::string> names = reader.getAllRecords();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"data.pkl", "data/0", "data/1", "version"}));
  for (const std::string& name : names) {
    auto [data, size] = reader.getRecord(name);
    EXPECT_EQ(std::string(static_cast<const char*>(data.get()), size), Record(path, name).bytes) << name;
  }
  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(Find(*back, "w")->as_tensor().storage->bytes.data[999], static_cast<uint8_t>(999 * 7));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The module `lint --deep` loads (found where the build put it: this test
// binary has no copy beside it) accepts that file, and refuses one without
// the `version` record, which reshard's reader does not need but torch.load's
// does, and a truncated one.
TEST(TorchCheckTest, ModuleReadsTheFileAsTorchLoadWould) {
  Result<const TorchCheck*> check = TorchCheck::Load();
  ASSERT_TRUE(check.ok()) << check.status().message();
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  ASSERT_TRUE(WriteTorchFile(path, TestRoot()).ok());
  Status st = (*check)->Check(path);
  EXPECT_TRUE(st.ok()) << st.message();

  const std::string good = ReadAll(path);
  std::string unversioned = good;  // x/version -> x/versiom, in its local header and directory entry
  for (size_t i = 0; (i = unversioned.find("x/version", i)) != std::string::npos;) unversioned[i + 8] = 'm';
  const std::string cut = good.substr(0, good.size() / 2);
  const std::string prefix = path + ": LibTorch's reader (PyTorchStreamReader) refuses it: ";
  for (const std::string& bytes : {unversioned, cut}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    st = (*check)->Check(path);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), Status::Code::kInvalidInput);
    EXPECT_EQ(st.message().substr(0, prefix.size()), prefix) << st.message();
    EXPECT_GT(st.message().size(), prefix.size()) << "LibTorch's reason is missing";
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << st.message();
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << unversioned;
  EXPECT_TRUE(ReadTorchFile(path).ok());  // only the cross-check finds it
}

}  // namespace
}  // namespace reshard
