#include "container/zip_directory.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "container/torch_file.h"
#include "container/zip_writer.h"
#include "test_util.h"

namespace reshard {
namespace {

using namespace std::string_literals;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

uint64_t Le(const std::string& b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[at + i]);
  return v;
}

void Put(std::string* b, size_t at, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) (*b)[at + i] = static_cast<char>(v >> (8 * i));
}

// A zip written by ZipWriter under x/: records "a" (3 bytes) and "b" (5 bytes), then version.
std::string WriteZip(const std::string& path, const ZipWriterOptions& options = {}) {
  auto zip = ZipWriter::Create(path, options);
  EXPECT_TRUE(zip.ok());
  EXPECT_TRUE((*zip)->Add("a", reinterpret_cast<const uint8_t*>("abc"), 3).ok());
  EXPECT_TRUE((*zip)->Add("b", reinterpret_cast<const uint8_t*>("hello"), 5).ok());
  EXPECT_TRUE((*zip)->Finish().ok());
  return ReadAll(path);
}

Result<ZipDirectory> ReadBytes(const std::string& path, const std::string& bytes) {
  WriteAll(path, bytes);
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  return ZipDirectory::Read(*file);
}

void ExpectRefused(const Result<ZipDirectory>& r, const std::string& fragment) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(r.status().message().find(fragment), std::string::npos) << r.status().message();
}

// Offsets inside a WriteZip file.
struct Layout {
  size_t central;  // of the first central header
  size_t end;      // of the end record
};
Layout LayoutOf(const std::string& b) {
  const size_t end = b.size() - 22;
  return {static_cast<size_t>(Le(b, end + 16, 4)), end};
}

TEST(ZipDirectoryTest, FindsRecordsInTheArchiveFolder) {
  TempDir dir;
  for (uint64_t threshold : {uint64_t{0xFFFFFFFF}, uint64_t{0}}) {  // plain, and every field ZIP64
    const std::string path = (dir.path() / "x.pt").string();
    ZipWriterOptions options;
    options.zip64_threshold = threshold;
    const std::string bytes = WriteZip(path, options);
    Result<ZipDirectory> zip = ReadBytes(path, bytes);
    ASSERT_TRUE(zip.ok()) << zip.status().message();
    const ZipRecord* b = zip->Find("b");
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->size, 5u);
    EXPECT_EQ(bytes.substr(b->data_offset, 5), "hello");
    EXPECT_EQ(b->data_offset % 64, 0u);
    EXPECT_NE(zip->Find("version"), nullptr);
    EXPECT_EQ(zip->Find("x/b"), nullptr);
    EXPECT_EQ(zip->Find("c"), nullptr);
  }
}

TEST(ZipDirectoryTest, CompressedRecordsAreRefused) {
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  std::string bytes = WriteZip(path);
  Put(&bytes, 8, 8, 2);                          // local header of x/a: deflate
  Put(&bytes, LayoutOf(bytes).central + 10, 8, 2);  // and its directory entry
  ExpectRefused(ReadBytes(path, bytes),
                "x.pt: zip record 'x/a' is compressed (method 8), but torch.save stores records "
                "uncompressed and reshard reads them in place; re-save the file with torch.save");
}

TEST(ZipDirectoryTest, LocalHeaderMustMatchTheDirectory) {
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  const std::string good = WriteZip(path);
  const std::string mismatch = "zip record 'x/a' does not match its local header";
  std::string name = good;
  name[30 + 2] = 'z';  // "x/a" -> "x/z" in the local header only
  ExpectRefused(ReadBytes(path, name), mismatch);
  std::string size = good;
  Put(&size, 22, 2, 4);  // local uncompressed size 3 -> 2
  ExpectRefused(ReadBytes(path, size), mismatch);
  std::string method = good;
  Put(&method, LayoutOf(method).central + 10, 0, 2);
  Put(&method, 8, 12, 2);  // bzip2 in the local header only
  ExpectRefused(ReadBytes(path, method), mismatch);
  std::string signature = good;
  signature[0] = 'Q';
  ExpectRefused(ReadBytes(path, signature), mismatch);
}

TEST(ZipDirectoryTest, SizesAndOffsetsMustLieInsideTheFile) {
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  const std::string good = WriteZip(path);
  const Layout at = LayoutOf(good);
  // A record's size reaching past the directory (sizes agree everywhere).
  std::string long_record = good;
  Put(&long_record, 18, 0xFFFFFFF0, 4);
  Put(&long_record, 22, 0xFFFFFFF0, 4);
  Put(&long_record, at.central + 20, 0xFFFFFFF0, 4);
  Put(&long_record, at.central + 24, 0xFFFFFFF0, 4);
  ExpectRefused(ReadBytes(path, long_record), "zip record 'x/a' runs past the records' end");
  // A local header offset beyond the file.
  std::string far = good;
  Put(&far, at.central + 42, 0xFFFFFF00, 4);
  ExpectRefused(ReadBytes(path, far), "does not match its local header");
  // The directory outside the file.
  std::string directory = good;
  Put(&directory, at.end + 16, 0xFFFFFF00, 4);
  ExpectRefused(ReadBytes(path, directory), "its zip central directory lies outside the file");
  // More entries than the directory holds.
  std::string count = good;
  Put(&count, at.end + 8, 400, 2);
  Put(&count, at.end + 10, 400, 2);
  ExpectRefused(ReadBytes(path, count), "its zip central directory is damaged");
  // A ZIP64 end record that is not there.
  std::string zip64 = good;
  Put(&zip64, at.end + 16, 0xFFFFFFFF, 4);
  ExpectRefused(ReadBytes(path, zip64), "its ZIP64 end record is missing or damaged");
  for (size_t n : {size_t{0}, size_t{10}, good.size() / 2, good.size() - 1}) {
    ExpectRefused(ReadBytes(path, good.substr(0, n)), "no zip end record");
  }
}

TEST(ZipDirectoryTest, DuplicateNamesAreRefused) {
  TempDir dir;
  const std::string path = (dir.path() / "x.pt").string();
  auto zip = ZipWriter::Create(path);
  ASSERT_TRUE(zip.ok());
  ASSERT_TRUE((*zip)->Add("data/0", reinterpret_cast<const uint8_t*>("ab"), 2).ok());
  ASSERT_TRUE((*zip)->Add("data/0", reinterpret_cast<const uint8_t*>("cd"), 2).ok());
  ASSERT_TRUE((*zip)->Finish().ok());
  ExpectRefused(ReadBytes(path, ReadAll(path)), "zip record 'x/data/0' appears twice");
}

// ---- Storages against their records (ReadTorchFile) ------------------------------------

// data.pkl of {'w': tensor} over ('storage', FloatStorage, '0', 'cpu', numel) with `size`
// elements, and the record data/0 of `record` bytes.
std::string StoragePickle(const std::string& numel, const std::string& size) {
  return "\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00"
         "storagectorch\nFloatStorage\nX\x01\x00\x00\x00"
         "0X\x03\x00\x00\x00"
         "cpu"s +
         numel + "tQK\x00"s + size + "\x85K\x01\x85\x89tRs."s;
}

Status WriteStorageFile(const std::string& path, const std::string& pickle, size_t record) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<ZipWriter> zip, ZipWriter::Create(path));
  RESHARD_RETURN_IF_ERROR(zip->Add("data.pkl", reinterpret_cast<const uint8_t*>(pickle.data()),
                                   static_cast<int64_t>(pickle.size())));
  const std::string bytes(record, '\0');
  RESHARD_RETURN_IF_ERROR(zip->Add("data/0", reinterpret_cast<const uint8_t*>(bytes.data()),
                                   static_cast<int64_t>(bytes.size())));
  return zip->Finish();
}

TEST(ZipDirectoryTest, StorageMustFillItsRecordExactly) {
  TempDir dir;
  const std::string path = (dir.path() / "t.pt").string();
  ASSERT_TRUE(WriteStorageFile(path, StoragePickle("K\x10", "K\x10"), 64).ok());
  Result<Value> ok = ReadTorchFile(path);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(Find(*ok, "w")->as_tensor().storage->bytes.size, 64u);

  struct Case {
    std::string numel;
    size_t record;
    std::string declared;
  };
  const Case cases[] = {
      // 2^62 + 16 elements: their byte count wraps to 64 in 64 bits.
      {"\x8a\x08\x10\x00\x00\x00\x00\x00\x00\x40"s, 64, "4611686018427387920"},
      {"K\x10", 32, "16"},   // short: the next record would be read as its end
      {"K\x10", 128, "16"},  // long
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(WriteStorageFile(path, StoragePickle(c.numel, "K\x10"), c.record).ok());
    Result<Value> r = ReadTorchFile(path);
    ASSERT_FALSE(r.ok()) << c.declared;
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
    EXPECT_EQ(r.status().message(), path + ": storage 'data/0' declares " + c.declared +
                                        " float32 elements, but its record holds " +
                                        std::to_string(c.record) + " bytes; the file is damaged");
  }
}

// data.pkl is read through ZipDirectory as the storages are, with its CRC-32 checked.
TEST(ZipDirectoryTest, DataPklIsAStoredRecordOfTheArchiveFolder) {
  TempDir dir;
  const std::string path = (dir.path() / "t.pt").string();
  ASSERT_TRUE(WriteStorageFile(path, StoragePickle("K\x10", "K\x10"), 64).ok());
  const std::string good = ReadAll(path);
  auto read = [&](const std::string& bytes) {
    WriteAll(path, bytes);
    return ReadTorchFile(path);
  };

  std::string compressed = good;
  Put(&compressed, 8, 8, 2);                               // local header of t/data.pkl: deflate
  Put(&compressed, LayoutOf(compressed).central + 10, 8, 2);  // and its directory entry
  Result<Value> r = read(compressed);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), path + ": zip record 't/data.pkl' is compressed (method 8), but "
                                         "torch.save stores records uncompressed and reshard reads "
                                         "them in place; re-save the file with torch.save");

  std::string damaged = good;
  const size_t at = Le(good, 26, 2) + Le(good, 28, 2) + 30 + 1;  // data.pkl's second byte
  damaged[at] ^= 0x01;  // PROTO 2 becomes PROTO 3: still a pickle, but not the one saved
  r = read(damaged);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), path + ": its data.pkl does not have the CRC-32 its zip directory "
                                         "records; the file is damaged");

  std::string renamed = good;  // t/data.pkl -> t/data.pkx, in its local header and directory entry
  for (size_t i = 0; (i = renamed.find("t/data.pkl", i)) != std::string::npos;) renamed[i + 9] = 'x';
  r = read(renamed);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
  EXPECT_EQ(r.status().message(), path + " has no data.pkl; it is not a torch.save file");
}

}  // namespace
}  // namespace reshard
