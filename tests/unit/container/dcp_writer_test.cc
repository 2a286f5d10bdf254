// The Distributed Checkpoint writer: files laid out before they are written,
// each item a torch 2.6 archive, read back by reshard's own DCP reader bit
// for bit, the `.metadata` included.
#include "container/dcp_writer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "container/dcp_item.h"
#include "container/zip_directory.h"
#include "test_util.h"
#include "util/shape.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// A tensor item of the pattern PatternProducer makes (scale 1, shift `shift`).
DcpWriteItem Chunk(const std::string& fqn, DType dtype, std::vector<int64_t> size, Box chunk,
                   double shift = 0) {
  ByteProducer produce = PatternProducer(dtype, size, Box{chunk.offsets, chunk.sizes}, 1, shift);
  return DcpTensorItem(fqn, dtype, std::move(size), std::move(chunk), std::move(produce));
}

// Two files: uneven row chunks (5 rows as 3 + 2), bf16 column chunks, 3-d
// chunks, whole fp16 and int64 tensors, a 0-d tensor and bytes items.
std::vector<DcpFileLayout> SampleFiles(const DcpWriteOptions& options = {}) {
  std::vector<DcpWriteItem> rank0, rank1;
  rank0.push_back(Chunk("w_uneven", DType::kFloat32, {5, 7}, {{0, 0}, {3, 7}}));
  rank1.push_back(Chunk("w_uneven", DType::kFloat32, {5, 7}, {{3, 0}, {2, 7}}));
  rank0.push_back(Chunk("w_col", DType::kBFloat16, {6, 10}, {{0, 0}, {6, 5}}));
  rank1.push_back(Chunk("w_col", DType::kBFloat16, {6, 10}, {{0, 5}, {6, 5}}));
  rank0.push_back(Chunk("cube", DType::kFloat32, {2, 3, 4}, {{0, 0, 0}, {2, 3, 2}}));
  rank1.push_back(Chunk("cube", DType::kFloat32, {2, 3, 4}, {{0, 0, 2}, {2, 3, 2}}));
  rank0.push_back(Chunk("half", DType::kFloat16, {3, 4}, {{0, 0}, {3, 4}}, 0.5));
  rank1.push_back(Chunk("ids", DType::kInt64, {4}, {{0}, {4}}, -(int64_t{1} << 40)));
  rank1.push_back(Chunk("scalar", DType::kFloat32, {}, {{}, {}}, 2.5));
  rank0.push_back(DcpBytesItem("step", Value::Int(7)));
  Value note = Value::MakeDict();
  Set(note, "list", Value::MakeList({Value::Int(1), Value::Float(2.5), Value::String("x"), Value(),
                                     Value::MakeTuple({Value::Int(3), Value::Int(4)})}));
  rank1.push_back(DcpBytesItem("note", std::move(note)));
  std::vector<DcpFileLayout> files;
  files.push_back(*LayOutDcpFile("__0_0.distcp", std::move(rank0), options));
  files.push_back(*LayOutDcpFile("__1_0.distcp", std::move(rank1), options));
  return files;
}

// Writes `files` (each in one run) and their `.metadata` into `dir`.
void WriteAll(const std::vector<DcpFileLayout>& files, const fs::path& dir) {
  std::vector<uint8_t> buffer(24);
  std::vector<const DcpFileLayout*> layouts;
  for (const DcpFileLayout& f : files) {
    Result<FileDigest> d = WriteDcpItems((dir / f.name).string(), f, 0, f.items.size(), &buffer, {});
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->bytes, static_cast<int64_t>(f.size));
    layouts.push_back(&f);
  }
  Result<std::string> metadata = DcpMetadataPickle(layouts);
  ASSERT_TRUE(metadata.ok()) << metadata.status().message();
  std::ofstream(dir / ".metadata", std::ios::binary) << *metadata;
}

std::string Expected(const DcpWriteItem& item) {
  std::string bytes(static_cast<size_t>(ShapeNumel(item.chunk.sizes) * ElementSize(item.dtype)), '\0');
  EXPECT_TRUE(item.produce(0, static_cast<int64_t>(bytes.size()), reinterpret_cast<uint8_t*>(bytes.data())).ok());
  return bytes;
}

std::string Bytes(const Value& tensor) {
  const Tensor& t = tensor.as_tensor();
  const size_t n = static_cast<size_t>(t.numel() * ElementSize(t.storage->dtype));
  return std::string(reinterpret_cast<const char*>(t.storage->bytes.data), n);
}

TEST(DcpWriterTest, WhatItWritesReadsBackBitForBit) {
  TempDir dir;
  const std::vector<DcpFileLayout> files = SampleFiles();
  WriteAll(files, dir.path());
  Result<DcpMetadata> meta = ReadDcpMetadata((dir.path() / ".metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  EXPECT_EQ(meta->items.size(), 8u);
  EXPECT_EQ(meta->storage.size(), 11u);
  const DcpItem& uneven = meta->items.at("w_uneven");
  EXPECT_EQ(uneven.dtype, DType::kFloat32);
  EXPECT_EQ(uneven.size, (std::vector<int64_t>{5, 7}));
  ASSERT_EQ(uneven.chunks.size(), 2u);
  EXPECT_EQ(uneven.chunks[1].offsets, (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(uneven.chunks[1].sizes, (std::vector<int64_t>{2, 7}));
  EXPECT_EQ(meta->items.at("w_col").dtype, DType::kBFloat16);
  EXPECT_EQ(meta->items.at("half").dtype, DType::kFloat16);
  EXPECT_EQ(meta->items.at("ids").dtype, DType::kInt64);
  EXPECT_TRUE(meta->items.at("scalar").size.empty());
  EXPECT_EQ(meta->items.at("step").kind, DcpItem::Kind::kBytes);

  for (const DcpFileLayout& f : files) {
    auto file = MappedFile::Open((dir.path() / f.name).string());
    ASSERT_TRUE(file.ok());
    for (size_t i = 0; i < f.items.size(); ++i) {
      const DcpWriteItem& item = f.items[i];
      SCOPED_TRACE(item.fqn);
      if (item.kind == DcpItem::Kind::kBytes) {
        const DcpStorage* where = meta->Find(item.fqn, {});
        ASSERT_NE(where, nullptr);
        Result<Value> object = ReadDcpItem(*file, *where);
        ASSERT_TRUE(object.ok()) << object.status().message();
        EXPECT_EQ(object->DebugString(), item.object.DebugString());
        continue;
      }
      const DcpStorage* where = meta->Find(item.fqn, item.chunk.offsets);
      ASSERT_NE(where, nullptr);
      EXPECT_EQ(where->relative_path, f.name);
      EXPECT_EQ(where->offset, f.places[i].offset);
      EXPECT_EQ(where->length, f.places[i].length);
      Result<Value> chunk = ReadDcpChunk(*file, *meta, item.fqn, item.chunk);
      ASSERT_TRUE(chunk.ok()) << chunk.status().message();
      EXPECT_EQ(chunk->as_tensor().storage_offset, 0);
      EXPECT_EQ(chunk->as_tensor().storage->numel, chunk->as_tensor().numel());
      EXPECT_EQ(Bytes(*chunk), Expected(item));
    }
  }
}

// As torch 2.6 writes an item: its records in torch.save's order, each
// record's data 64-byte aligned from the item's start, items back to back
// filling the file.
TEST(DcpWriterTest, ItemsAreTorchArchivesBackToBack) {
  TempDir dir;
  const std::vector<DcpFileLayout> files = SampleFiles();
  WriteAll(files, dir.path());
  const DcpFileLayout& f = files[0];
  EXPECT_EQ(fs::file_size(dir.path() / f.name), f.size);
  auto file = MappedFile::Open((dir.path() / f.name).string());
  ASSERT_TRUE(file.ok());
  uint64_t end = 0;
  for (size_t i = 0; i < f.items.size(); ++i) {
    EXPECT_EQ(f.places[i].offset, end);
    end += f.places[i].length;
    Result<ZipDirectory> zip = ZipDirectory::Read(**file, FileWindow{f.places[i].offset, f.places[i].length});
    ASSERT_TRUE(zip.ok()) << zip.status().message();
    std::vector<std::pair<uint64_t, std::string>> records;
    for (const auto& [name, r] : zip->records()) {
      EXPECT_EQ((r.data_offset - f.places[i].offset) % 64, 0u) << name;
      records.emplace_back(r.data_offset, name);
    }
    std::sort(records.begin(), records.end());
    std::vector<std::string> names;
    for (const auto& r : records) names.push_back(r.second);
    std::vector<std::string> want = {"archive/data.pkl", "archive/byteorder", "archive/data/0", "archive/version",
                                     "archive/.data/serialization_id"};
    if (f.items[i].kind == DcpItem::Kind::kBytes) want.erase(want.begin() + 2);
    EXPECT_EQ(names, want);
    EXPECT_EQ(zip->Find("byteorder")->size, 6u);
  }
  EXPECT_EQ(end, f.size);
}

TEST(DcpWriterTest, RunsOfItemsMakeTheSameFileAsOneRun) {
  TempDir one, parts;
  const std::vector<DcpFileLayout> files = SampleFiles();
  WriteAll(files, one.path());
  const DcpFileLayout& f = files[1];
  const std::vector<size_t> cuts = DcpCuts(f, 1);  // every item a run
  ASSERT_EQ(cuts.size(), f.items.size() + 1);
  std::vector<uint8_t> buffer(8);
  int64_t total = 0;
  for (size_t i = cuts.size() - 1; i-- > 0;) {  // last first: no run relies on another
    Result<FileDigest> d = WriteDcpItems((parts.path() / f.name).string(), f, cuts[i], cuts[i + 1], &buffer, {});
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->offset, static_cast<int64_t>(f.places[cuts[i]].offset));
    total += d->bytes;
  }
  EXPECT_EQ(total, static_cast<int64_t>(f.size));
  std::ifstream a(one.path() / f.name, std::ios::binary), b(parts.path() / f.name, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}), std::string(std::istreambuf_iterator<char>(b), {}));
  EXPECT_EQ(DcpCuts(f, int64_t{1} << 40), (std::vector<size_t>{0, f.items.size()}));
}

TEST(DcpWriterTest, Zip64RecordsReadBack) {
  TempDir dir;
  DcpWriteOptions options;
  options.zip64_threshold = 16;  // every tensor record, every directory offset
  const std::vector<DcpFileLayout> files = SampleFiles(options);
  WriteAll(files, dir.path());
  Result<DcpMetadata> meta = ReadDcpMetadata((dir.path() / ".metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  auto file = MappedFile::Open((dir.path() / files[0].name).string());
  ASSERT_TRUE(file.ok());
  const DcpWriteItem& item = files[0].items[0];
  Result<Value> chunk = ReadDcpChunk(*file, *meta, item.fqn, item.chunk);
  ASSERT_TRUE(chunk.ok()) << chunk.status().message();
  EXPECT_EQ(Bytes(*chunk), Expected(item));
}

TEST(DcpWriterTest, RefusesWhatTorchWouldNotRead) {
  const auto produce = PatternProducer(DType::kFloat32, {4}, Box{{0}, {4}}, 1, 0);
  Result<DcpFileLayout> outside =
      LayOutDcpFile("__0_0.distcp", {DcpTensorItem("w", DType::kFloat32, {4}, {{2}, {3}}, produce)});
  EXPECT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("outside its tensor"), std::string::npos);

  Result<DcpFileLayout> tensor_object = LayOutDcpFile(
      "__0_0.distcp", {DcpBytesItem("o", MakeProducedTensor(DType::kFloat32, {4}, produce))});
  EXPECT_FALSE(tensor_object.ok());
  EXPECT_FALSE(LayOutDcpFile("../x.distcp", {}).ok());

  Result<DcpFileLayout> overlapping = LayOutDcpFile(
      "__0_0.distcp", {DcpTensorItem("w", DType::kFloat32, {4}, {{0}, {3}}, produce),
                       DcpTensorItem("w", DType::kFloat32, {4}, {{2}, {2}}, produce)});
  ASSERT_TRUE(overlapping.ok());
  Result<std::string> metadata = DcpMetadataPickle({&*overlapping});
  EXPECT_FALSE(metadata.ok());
  EXPECT_NE(metadata.status().message().find("overlap"), std::string::npos) << metadata.status().message();

  Result<DcpFileLayout> missing =
      LayOutDcpFile("__0_0.distcp", {DcpTensorItem("w", DType::kFloat32, {4}, {{0}, {3}}, produce)});
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(DcpMetadataPickle({&*missing}).ok());
}

}  // namespace
}  // namespace reshard
