#include "container/torch_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "container/record_crc.h"
#include "container/zip_directory.h"
#include "test_util.h"

namespace reshard {
namespace {

// A bf16 tensor of `values` (stored as the top halves of the floats).
Value Bf16Tensor(const std::vector<float>& values, std::vector<int64_t> sizes) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) StoreFromDouble(DType::kBFloat16, values[i], bytes->data() + 2 * i);
  auto storage = std::make_shared<Storage>();
  storage->dtype = DType::kBFloat16;
  storage->numel = static_cast<int64_t>(values.size());
  storage->bytes = ByteView{bytes, bytes->data(), bytes->size()};
  Tensor t;
  t.storage = storage;
  t.sizes = std::move(sizes);
  t.strides = Tensor::ContiguousStrides(t.sizes);
  return Value::MakeTensor(std::move(t));
}

TEST(TorchFileTest, WriteThenReadKeepsOrderDtypesAndBytes) {
  TempDir dir;
  const std::string path = (dir.path() / "layer_01-model_00-model_states.pt").string();
  Value root = MakeOrderedDict({{Value::String("b.weight"), Bf16Tensor({1, 2, 3, 4, 5, 6}, {2, 3})},
                                {Value::String("a.bias"), Bf16Tensor({-1.5, 0.25}, {2})}});
  ASSERT_TRUE(WriteTorchFile(path, root).ok());

  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const Items* items = DictItems(*back);
  ASSERT_NE(items, nullptr);
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].first.as_string(), "b.weight");
  EXPECT_EQ((*items)[1].first.as_string(), "a.bias");
  const Tensor& bias = (*items)[1].second.as_tensor();
  EXPECT_EQ(bias.storage->dtype, DType::kBFloat16);
  EXPECT_EQ(bias.sizes, (std::vector<int64_t>{2}));
  EXPECT_EQ(bias.storage->numel, 2);  // compact storage
  EXPECT_EQ(LoadAsDouble(DType::kBFloat16, bias.storage->bytes.data + 2), 0.25);
}

// Storages come from the file's map: reading costs no copy of the data.
TEST(TorchFileTest, StoragesPointIntoTheFileMapping) {
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  ASSERT_TRUE(WriteTorchFile(path, MakeOrderedDict({{Value::String("w"), Bf16Tensor({7, 8}, {2})}})).ok());
  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok());
  const Storage& s = *Find(*back, "w")->as_tensor().storage;
  EXPECT_EQ(s.record_key, "0");
  EXPECT_NE(s.bytes.owner, nullptr);
  EXPECT_EQ(s.bytes.size, 4u);
}

// A tensor big enough that its record is copied by the kernel.
Value LargeTensor() {
  std::vector<float> values(1 << 17);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 128);  // exact in bf16
  return MakeOrderedDict({{Value::String("w"), Bf16Tensor(values, {static_cast<int64_t>(values.size())})}});
}

ZipRecord RecordOf(const std::string& path, const std::string& name) {
  auto file = MappedFile::Open(path);
  EXPECT_TRUE(file.ok());
  auto zip = ZipDirectory::Read(**file);
  EXPECT_TRUE(zip.ok());
  return *zip->Find(name);
}

// A source record written again whole: the target record's CRC is the one
// computed as the source was read and checked, and it is the CRC its bytes have.
TEST(TorchFileTest, ARecordCopiedWholeKeepsItsCrcAndReadsBack) {
  TempDir dir;
  const std::string source = (dir.path() / "source.pt").string(), target = (dir.path() / "target.pt").string();
  ASSERT_TRUE(WriteTorchFile(source, LargeTensor()).ok());
  {
    Result<Value> read = ReadTorchFile(source);
    ASSERT_TRUE(read.ok());
    ASSERT_TRUE(WriteTorchFile(target, *read).ok());
    EXPECT_TRUE(CheckReadRecords().ok());
  }
  EXPECT_EQ(RecordOf(target, "data/0").crc, RecordOf(source, "data/0").crc);
  Result<Value> back = ReadTorchFile(target);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const Storage& s = *Find(*back, "w")->as_tensor().storage;
  EXPECT_EQ(LoadAsDouble(DType::kBFloat16, s.bytes.data + 2 * 1000), 1000 % 128);
  EXPECT_EQ(Crc32(0, s.bytes.data, s.bytes.size), RecordOf(target, "data/0").crc);
}

TEST(TorchFileTest, ADamagedSourceRecordCopiedWholeIsStillRefused) {
  TempDir dir;
  const std::string source = (dir.path() / "source.pt").string(), target = (dir.path() / "target.pt").string();
  ASSERT_TRUE(WriteTorchFile(source, LargeTensor()).ok());
  const ZipRecord record = RecordOf(source, "data/0");
  {
    std::fstream f(source, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(record.data_offset + 1000));
    f.put('\x55');
  }
  Result<Value> read = ReadTorchFile(source);
  ASSERT_TRUE(read.ok());
  ASSERT_TRUE(WriteTorchFile(target, *read).ok());
  const Status checked = CheckReadRecords();
  EXPECT_EQ(checked.code(), Status::Code::kInvalidInput);
  EXPECT_NE(checked.message().find("source.pt: record"), std::string::npos) << checked.message();
}

// Two archives in one file, as a Distributed Checkpoint's `.distcp` file
// holds its items: a damaged byte in the first is found after the second
// was read too (the second's checks must not replace the first's).
TEST(TorchFileTest, EveryArchiveOfAFileIsChecked) {
  TempDir dir;
  const std::string one = (dir.path() / "one.pt").string(), joined = (dir.path() / "items.distcp").string();
  ASSERT_TRUE(WriteTorchFile(one, LargeTensor()).ok());
  std::ifstream in(one, std::ios::binary);
  const std::string archive((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const ZipRecord record = RecordOf(one, "data/0");
  std::string file = archive + archive;
  file[record.data_offset + 1000] ^= 0x55;  // in the first archive only
  std::ofstream(joined, std::ios::binary) << file;
  Result<std::shared_ptr<const MappedFile>> mapped = MappedFile::Open(joined);
  ASSERT_TRUE(mapped.ok());
  std::vector<uint8_t> copy(record.size);
  for (const uint64_t at : {uint64_t{0}, static_cast<uint64_t>(archive.size())}) {
    Result<Value> read = ReadTorchArchive(*mapped, FileWindow{at, archive.size()});
    ASSERT_TRUE(read.ok()) << read.status().message();
    ASSERT_TRUE(ReadTorchArchive(*mapped, FileWindow{at, archive.size()}).ok());  // read twice: counted once
    const Storage& s = *Find(*read, "w")->as_tensor().storage;
    CopyFromView(s.bytes, s.bytes.data, s.bytes.size, copy.data(), nullptr);
  }
  const Status checked = CheckReadRecords();
  EXPECT_EQ(checked.code(), Status::Code::kInvalidInput);
  EXPECT_NE(checked.message().find("items.distcp: record "), std::string::npos) << checked.message();
  EXPECT_NE(checked.message().find("/data/0 of the item at bytes 0-" + std::to_string(archive.size()) +
                                   " does not have the CRC-32"),
            std::string::npos)
      << checked.message();
  EXPECT_TRUE(PartlyReadRecords().empty());
}

TEST(TorchFileTest, ReadsWhatTorchSaveWrote) {
  TempDir dir;
  const std::string path = (dir.path() / "t.pt").string();
  const std::string cmd = std::string(RESHARD_PYTHON) +
                          " -c \"import torch, collections; torch.save(collections.OrderedDict("
                          "w=torch.arange(12, dtype=torch.float32).reshape(3, 4)[1:], "
                          "h=torch.ones(3, dtype=torch.float16)), '" + path + "')\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const Tensor& w = Find(*back, "w")->as_tensor();
  EXPECT_EQ(w.sizes, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(w.storage_offset, 4);  // a view: torch.save kept the whole storage
  EXPECT_EQ(w.storage->numel, 12);
  float first;
  std::memcpy(&first, w.storage->bytes.data + 4 * w.storage_offset, 4);
  EXPECT_EQ(first, 4.0f);
  EXPECT_EQ(Find(*back, "h")->as_tensor().storage->dtype, DType::kFloat16);
}

// Records are found in the folder of the zip's first record, whatever its name, as
// torch.load's reader finds them; a data.pkl in another folder is not the file's.
TEST(TorchFileTest, ArchiveFolderIsThatOfTheFirstRecord) {
  TempDir dir;
  const std::string saved = (dir.path() / "saved.pt").string();
  const std::string moved = (dir.path() / "moved.pt").string();
  const std::string stray = (dir.path() / "stray.pt").string();
  const std::string cmd = std::string(RESHARD_PYTHON) + " -c \"import torch, zipfile\n"
      "torch.save({'w': torch.arange(3.0)}, '" + saved + "')\n"
      "records = [(i.filename.split('/', 1)[1], zipfile.ZipFile('" + saved + "').read(i))\n"
      "           for i in zipfile.ZipFile('" + saved + "').infolist()]\n"
      "with zipfile.ZipFile('" + moved + "', 'w') as z:\n"
      "    for name, data in records: z.writestr('elsewhere/' + name, data)\n"
      "with zipfile.ZipFile('" + stray + "', 'w') as z:\n"
      "    for name, data in sorted(records, key=lambda r: r[0] == 'data.pkl'):\n"
      "        z.writestr(('other/' if name == 'data.pkl' else 'saved/') + name, data)\n"
      "\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  for (const std::string& path : {saved, moved}) {
    Result<Value> back = ReadTorchFile(path);
    ASSERT_TRUE(back.ok()) << back.status().message();
    float second;
    std::memcpy(&second, Find(*back, "w")->as_tensor().storage->bytes.data + 4, 4);
    EXPECT_EQ(second, 1.0f);
  }
  Result<Value> r = ReadTorchFile(stray);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), stray + " has no data.pkl; it is not a torch.save file");
}

TEST(TorchFileTest, RefusesNonCheckpointAndTruncatedFiles) {
  TempDir dir;
  const std::string junk = (dir.path() / "junk.pt").string();
  std::ofstream(junk) << "not a zip file at all";
  Result<Value> r = ReadTorchFile(junk);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(r.status().message().find("is not a torch.save zip file"), std::string::npos);

  const std::string good = (dir.path() / "good.pt").string();
  ASSERT_TRUE(WriteTorchFile(good, MakeOrderedDict({{Value::String("w"), Bf16Tensor({1, 2, 3}, {3})}})).ok());
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = (dir.path() / "cut.pt").string();
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  Result<Value> t = ReadTorchFile(cut);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(t.status().message().find("cut.pt"), std::string::npos);
}

}  // namespace
}  // namespace reshard
