#include "container/zip_writer.h"

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "container/torch_file.h"
#include "pickle/pickle_writer.h"
#include "test_util.h"
#include "util/crc32.h"

namespace reshard {
namespace {

std::shared_ptr<Storage> MakeStorage(DType dtype, std::vector<uint8_t> bytes) {
  auto buffer = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  auto storage = std::make_shared<Storage>();
  storage->dtype = dtype;
  storage->numel = static_cast<int64_t>(buffer->size()) / ElementSize(dtype);
  storage->bytes = ByteView{buffer, buffer->data(), buffer->size()};
  return storage;
}

Value TensorOf(std::shared_ptr<Storage> storage, std::vector<int64_t> sizes) {
  Tensor t;
  t.storage = std::move(storage);
  t.strides = Tensor::ContiguousStrides(sizes);
  t.sizes = std::move(sizes);
  return Value::MakeTensor(std::move(t));
}

std::vector<uint8_t> Float32Range(int n) {
  std::vector<uint8_t> bytes(4 * n);
  for (int i = 0; i < n; ++i) StoreFromDouble(DType::kFloat32, i, &bytes[4 * i]);
  return bytes;
}

// The bytes of the test pattern at [offset, offset + n).
std::vector<uint8_t> Pattern(int64_t offset, int64_t n) {
  std::vector<uint8_t> bytes(n);
  for (int64_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>((offset + i) * 7 + (offset + i) / 251);
  return bytes;
}

// Writes `root` as a torch.save file: the pickle with Add, then each storage
// with Add, or streamed through `buffer_size` bytes when it has no bytes.
Status WriteWith(const std::string& path, const Value& root, const ZipWriterOptions& options,
                 size_t buffer_size = 7) {
  std::vector<std::pair<std::string, const Storage*>> storages;
  Result<std::string> pickle = WritePickle(root, [&](const std::string& key, const Storage& s) {
    storages.emplace_back(key, &s);
    return Status::Ok();
  });
  RESHARD_RETURN_IF_ERROR(pickle.status());
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<ZipWriter> zip, ZipWriter::Create(path, options));
  RESHARD_RETURN_IF_ERROR(zip->Add("data.pkl", reinterpret_cast<const uint8_t*>(pickle->data()),
                                   static_cast<int64_t>(pickle->size())));
  std::vector<uint8_t> buffer(buffer_size);
  for (const auto& [key, s] : storages) {
    const int64_t size = s->numel * ElementSize(s->dtype);
    if (s->bytes.data != nullptr) {
      RESHARD_RETURN_IF_ERROR(zip->Add("data/" + key, s->bytes.data, size));
    } else {
      RESHARD_RETURN_IF_ERROR(zip->AddStreamed("data/" + key, size, s->produce, &buffer));
    }
  }
  return zip->Finish();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `checks` (Python) after zipfile has opened `path` (as `z`, its bytes
// as `raw`) and verified what holds for every file ZipWriter writes: valid
// CRCs, data aligned to 64 bytes, the version record last.
bool CheckWithPython(const TempDir& dir, const std::string& path, const std::string& checks) {
  const std::string script = (dir.path() / "check.py").string();
  std::ofstream(script) << R"(import struct, sys, torch, zipfile
path = sys.argv[1]
z = zipfile.ZipFile(path)
assert z.testzip() is None, "bad CRC"
raw = open(path, "rb").read()
for info in z.infolist():
    assert info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
assert z.namelist()[-1].endswith("/version") and z.read(z.namelist()[-1]) == b"3\n"
)" << checks << "\n";
  const std::string cmd = std::string(RESHARD_PYTHON) + " " + script + " " + path;
  return std::system(cmd.c_str()) == 0;
}

bool Contains(const std::string& bytes, const std::string& what) {
  return bytes.find(what) != std::string::npos;
}

TEST(ZipWriterTest, TorchLoadReadsWhatItWrites) {
  TempDir dir;
  const std::string path = (dir.path() / "mp_rank_00_model_states.pt").string();
  Value root = MakeOrderedDict(
      {{Value::String("w"), TensorOf(MakeStorage(DType::kFloat32, Float32Range(1000)), {10, 100})},
       {Value::String("b"), TensorOf(MakeStorage(DType::kUInt8, {1, 2, 3}), {3})}});
  ASSERT_TRUE(WriteWith(path, root, {}).ok());

  EXPECT_TRUE(CheckWithPython(dir, path, R"(
sd = torch.load(path)
assert list(sd) == ["w", "b"]
assert torch.equal(sd["w"], torch.arange(1000, dtype=torch.float32).reshape(10, 100))
assert torch.equal(sd["b"], torch.tensor([1, 2, 3], dtype=torch.uint8))
assert z.namelist() == ["mp_rank_00_model_states/" + n for n in ["data.pkl", "data/0", "data/1", "version"]]
)"));
  EXPECT_FALSE(Contains(ReadAll(path), "PK\x06\x06"));  // small: no ZIP64 records
}

TEST(ZipWriterTest, StreamedRecordsHoldTheProducedBytes) {
  TempDir dir;
  const std::string path = (dir.path() / "streamed.pt").string();
  int64_t next = 0;  // the producer is asked for consecutive pieces
  auto produce = [&next](int64_t offset, int64_t length, uint8_t* dst) {
    if (offset != next || length > 7) return Status::Internal("unexpected piece");
    next = offset + length;
    std::vector<uint8_t> bytes = Pattern(offset, length);
    std::copy(bytes.begin(), bytes.end(), dst);
    return Status::Ok();
  };
  Value root = MakeOrderedDict(
      {{Value::String("tiny"), MakeProducedTensor(DType::kUInt8, {1001}, produce)},
       {Value::String("big"), TensorOf(MakeStorage(DType::kUInt8, Pattern(0, 3 << 20)), {3 << 20})}});
  ASSERT_TRUE(WriteWith(path, root, {}, 7).ok());
  EXPECT_EQ(next, 1001);

  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const ByteView& tiny = Find(*back, "tiny")->as_tensor().storage->bytes;
  EXPECT_EQ(std::vector<uint8_t>(tiny.data, tiny.data + tiny.size), Pattern(0, 1001));
  const ByteView& big = Find(*back, "big")->as_tensor().storage->bytes;
  EXPECT_TRUE(std::vector<uint8_t>(big.data, big.data + big.size) == Pattern(0, 3 << 20));
  EXPECT_TRUE(CheckWithPython(dir, path, R"(
sd = torch.load(path)
assert torch.equal(sd["tiny"], torch.tensor([(i * 7 + i // 251) % 256 for i in range(1001)], dtype=torch.uint8))
)"));
}

// Pieces larger than the writer's own buffer go to the file directly, and
// their CRC is patched into a header already in the file.
TEST(ZipWriterTest, LargeBufferWritesDirectly) {
  TempDir dir;
  const std::string path = (dir.path() / "direct.pt").string();
  ByteProducer produce = [](int64_t offset, int64_t length, uint8_t* dst) {
    std::vector<uint8_t> bytes = Pattern(offset, length);
    std::copy(bytes.begin(), bytes.end(), dst);
    return Status::Ok();
  };
  Value root = MakeOrderedDict({{Value::String("x"), MakeProducedTensor(DType::kUInt8, {500001}, produce)}});
  ASSERT_TRUE(WriteWith(path, root, {}, 200000).ok());
  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const ByteView& x = Find(*back, "x")->as_tensor().storage->bytes;
  EXPECT_TRUE(std::vector<uint8_t>(x.data, x.data + x.size) == Pattern(0, 500001));
  EXPECT_TRUE(CheckWithPython(dir, path, "assert torch.load(path)['x'].numel() == 500001"));
}

Value Zip64TestRoot() {
  return MakeOrderedDict(
      {{Value::String("small"), TensorOf(MakeStorage(DType::kUInt8, {9, 8, 7}), {3})},
       {Value::String("large"), TensorOf(MakeStorage(DType::kFloat32, Float32Range(300)), {300})}});
}

// With the threshold at 0 every size and offset is a ZIP64 field.
TEST(ZipWriterTest, Zip64FilesLoad) {
  TempDir dir;
  const std::string path = (dir.path() / "zip64.pt").string();
  ZipWriterOptions options;
  options.zip64_threshold = 0;
  ASSERT_TRUE(WriteWith(path, Zip64TestRoot(), options).ok());
  const std::string bytes = ReadAll(path);
  EXPECT_TRUE(Contains(bytes, "PK\x06\x06"));  // the ZIP64 end record
  EXPECT_TRUE(Contains(bytes, "PK\x06\x07"));  // and its locator

  Result<Value> back = ReadTorchFile(path);
  ASSERT_TRUE(back.ok()) << back.status().message();
  const ByteView& large = Find(*back, "large")->as_tensor().storage->bytes;
  EXPECT_EQ(std::vector<uint8_t>(large.data, large.data + large.size), Float32Range(300));
  caffe2::serialize::PyTorchStreamReader reader(path);  // and torch.load's reader
  auto [record, record_size] = reader.getRecord("data/1");
  const uint8_t* record_bytes = static_cast<const uint8_t*>(record.get());
  EXPECT_EQ(std::vector<uint8_t>(record_bytes, record_bytes + record_size), Float32Range(300));
  EXPECT_TRUE(CheckWithPython(dir, path, R"(
sd = torch.load(path)
assert torch.equal(sd["small"], torch.tensor([9, 8, 7], dtype=torch.uint8))
assert torch.equal(sd["large"], torch.arange(300, dtype=torch.float32))
assert all(i.extra[:4] == b"\x01\x00\x18\x00" for i in z.infolist())  # sizes and offset
)"));
}

// A mixed file: ZIP64 fields only for the values that reach the threshold.
// Only Python's zipfile reads it: PyTorch's reader (miniz) checks a 32-bit
// offset field against the file size before it looks at the ZIP64 field,
// a check that only real offsets (>= 4 GiB, in a larger file) pass.
TEST(ZipWriterTest, Zip64FieldsOnlyWhereNeeded) {
  TempDir dir;
  const std::string path = (dir.path() / "mixed.pt").string();
  ZipWriterOptions options;
  options.zip64_threshold = 700;
  ASSERT_TRUE(WriteWith(path, Zip64TestRoot(), options).ok());
  EXPECT_TRUE(CheckWithPython(dir, path, R"(
first, large, last = z.infolist()[0], z.getinfo("mixed/data/1"), z.infolist()[-1]
assert first.header_offset == 0 and first.extra == b""
assert last.extra == b"\x01\x00\x08\x00" + struct.pack("<Q", last.header_offset)  # the offset only
assert raw[large.header_offset + 30 + len(large.filename):][:4] == b"\x01\x00\x10\x00"  # local sizes
assert z.read(large) == torch.arange(300, dtype=torch.float32).numpy().tobytes()
)"));
}

TEST(ZipWriterTest, SameInputSameBytes) {
  TempDir first, second;
  Value root = MakeOrderedDict({{Value::String("w"), TensorOf(MakeStorage(DType::kUInt8, {1, 2}), {2})}});
  const std::string a = (first.path() / "x.pt").string(), b = (second.path() / "x.pt").string();
  ASSERT_TRUE(WriteWith(a, root, {}).ok());
  ASSERT_TRUE(WriteWith(b, root, {}).ok());
  EXPECT_EQ(ReadAll(a), ReadAll(b));
}

TEST(ZipWriterTest, ArchiveFolderIsNamedAfterTheFile) {
  TempDir dir;
  auto archive = [&](const std::string& name) {
    Result<std::unique_ptr<ZipWriter>> zip = ZipWriter::Create((dir.path() / name).string());
    return zip.ok() ? (*zip)->archive() : "error";
  };
  EXPECT_EQ(archive("layer_01-model_00-model_states.pt"), "layer_01-model_00-model_states");
  EXPECT_EQ(archive("my.model.pt"), "my.model");
  EXPECT_EQ(archive("noext"), "noext");
  EXPECT_EQ(archive(".pt"), "archive");
}

TEST(ZipWriterTest, ReportsErrors) {
  TempDir dir;
  Result<std::unique_ptr<ZipWriter>> missing = ZipWriter::Create((dir.path() / "no/such.pt").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Status::Code::kIoError);
  EXPECT_NE(missing.status().message().find("cannot write "), std::string::npos);

  Result<std::unique_ptr<ZipWriter>> zip = ZipWriter::Create((dir.path() / "x.pt").string());
  ASSERT_TRUE(zip.ok());
  std::vector<uint8_t> none;
  EXPECT_EQ((*zip)->AddStreamed("data/0", 1, nullptr, &none).code(), Status::Code::kInternal);
  std::vector<uint8_t> buffer(16);
  Status failed = (*zip)->AddStreamed(
      "data/0", 100, [](int64_t, int64_t, uint8_t*) { return Status::InvalidInput("no source"); },
      &buffer);
  EXPECT_EQ(failed.message(), "no source");
}

// The CRC bit by bit, as the zip specification defines it.
uint32_t BitwiseCrc32(const uint8_t* data, size_t n) {
  uint32_t crc = 0xFFFFFFFF;
  for (size_t i = 0; i < n; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320 & (0u - (crc & 1)));
  }
  return ~crc;
}

uint32_t Crc32Of(const std::string& s) {
  return Crc32(0, reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// The file CRC the writer reports is that of the bytes on disk, whether a
// record's header was patched in the buffer or in the file, with or
// without ZIP64 fields.
TEST(ZipWriterTest, FileCrcIsTheCrcOfTheFile) {
  for (uint64_t threshold : {uint64_t{0xFFFFFFFF}, uint64_t{0}}) {
    TempDir dir;
    const std::string path = (dir.path() / "crc.pt").string();
    ZipWriterOptions options;
    options.zip64_threshold = threshold;
    Result<std::unique_ptr<ZipWriter>> zip = ZipWriter::Create(path, options);
    ASSERT_TRUE(zip.ok());
    const std::vector<uint8_t> small = Pattern(3, 1000);
    ASSERT_TRUE((*zip)->Add("data.pkl", small.data(), static_cast<int64_t>(small.size())).ok());
    std::vector<uint8_t> buffer(300000);  // larger than the writer's own: written directly
    ByteProducer produce = [](int64_t offset, int64_t length, uint8_t* dst) {
      std::vector<uint8_t> bytes = Pattern(offset, length);
      std::copy(bytes.begin(), bytes.end(), dst);
      return Status::Ok();
    };
    ASSERT_TRUE((*zip)->AddStreamed("data/0", 700001, produce, &buffer).ok());
    ASSERT_TRUE((*zip)->AddStreamed("data/1", 0, produce, &buffer).ok());
    ASSERT_TRUE((*zip)->Finish().ok());
    const std::string bytes = ReadAll(path);
    EXPECT_EQ((*zip)->file_crc(), Crc32(0, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()))
        << "zip64 threshold " << threshold;
  }
}

TEST(Crc32Test, CombineIsTheCrcOfTheConcatenation) {
  const std::string a = "The quick brown fox ", b = "jumps over the lazy dog";
  const auto crc = [](const std::string& s) { return Crc32(0, reinterpret_cast<const uint8_t*>(s.data()), s.size()); };
  EXPECT_EQ(Crc32Combine(crc(a), crc(b), static_cast<int64_t>(b.size())), crc(a + b));
  EXPECT_EQ(Crc32Combine(crc(a), crc(""), 0), crc(a));
}

TEST(Crc32Test, KnownValues) {
  EXPECT_EQ(Crc32Of(""), 0u);
  EXPECT_EQ(Crc32Of("a"), 0xE8B7BE43u);
  EXPECT_EQ(Crc32Of("123456789"), 0xCBF43926u);
  EXPECT_EQ(Crc32Of("The quick brown fox jumps over the lazy dog"), 0x414FA339u);
  EXPECT_EQ(Crc32(0x1234, nullptr, 0), 0x1234u);
}

TEST(Crc32Test, MatchesBitwiseAtAnyLengthAndAlignment) {
  std::mt19937 random(42);
  std::vector<uint8_t> data(70000);
  for (uint8_t& b : data) b = static_cast<uint8_t>(random());
  for (size_t start = 0; start < 16; ++start) {
    for (size_t n : {1, 3, 7, 8, 15, 31, 33, 63, 255, 1001, 4093, 65537}) {
      const uint8_t* p = data.data() + start;
      const uint32_t expected = BitwiseCrc32(p, n);
      EXPECT_EQ(Crc32(0, p, n), expected) << start << " " << n;
      const size_t split = n / 3;  // continued over two calls
      EXPECT_EQ(Crc32(Crc32(0, p, split), p + split, n - split), expected) << start << " " << n;
    }
  }
}

}  // namespace
}  // namespace reshard
