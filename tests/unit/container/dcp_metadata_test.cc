#include "container/dcp_metadata.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>

#include "container/dcp_item.h"
#include "container/torch_file.h"
#include "pickle/pickle_writer.h"
#include "test_util.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// Real checkpoints written by torch 2.6 (dcp/) and Megatron-Core (megatron-core/).
const fs::path kData = fs::path(RESHARD_SOURCE_DIR) / "tests" / "data";

// Every `.metadata` under the shared data folder.
std::vector<fs::path> AllMetadataFiles() {
  std::vector<fs::path> out;
  for (const char* sub : {"dcp", "megatron-core"}) {
    for (const auto& e : fs::recursive_directory_iterator(kData / sub)) {
      if (e.path().filename() == ".metadata") out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t Volume(const std::vector<int64_t>& dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
}

TEST(DcpMetadataTest, ReadsEveryRealMetadataFile) {
  const std::vector<fs::path> files = AllMetadataFiles();
  EXPECT_EQ(files.size(), 27u);
  for (const fs::path& path : files) {
    SCOPED_TRACE(path.string());
    Result<DcpMetadata> meta = ReadDcpMetadata(path.string());
    ASSERT_TRUE(meta.ok()) << meta.status().message();
    size_t stored = 0;
    for (const auto& [fqn, item] : meta->items) {
      if (item.kind == DcpItem::Kind::kBytes) {
        ++stored;
        continue;
      }
      // The chunks written tile the tensor (a replica is written once).
      int64_t covered = 0;
      for (const Box& c : item.chunks) covered += Volume(c.sizes);
      EXPECT_EQ(covered, Volume(item.size)) << fqn;
      stored += item.chunks.size();
    }
    EXPECT_EQ(meta->storage.size(), stored);
    // The items of each .distcp file lie back to back and fill it.
    std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> windows;
    for (const auto& [key, s] : meta->storage) windows[s.relative_path].push_back({s.offset, s.length});
    for (auto& [file, w] : windows) {
      std::sort(w.begin(), w.end());
      uint64_t end = 0;
      for (const auto& [offset, length] : w) {
        EXPECT_EQ(offset, end) << file;
        end = offset + length;
      }
      EXPECT_EQ(end, fs::file_size(path.parent_path() / file)) << file;
    }
  }
}

TEST(DcpMetadataTest, Torch26DTensorSave) {
  Result<DcpMetadata> meta = ReadDcpMetadata((kData / "dcp/world2_dtensor/.metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  EXPECT_EQ(meta->items.size(), 9u);
  EXPECT_EQ(meta->storage.size(), 12u);
  const DcpItem& uneven = meta->items.at("w_uneven");
  ASSERT_EQ(uneven.kind, DcpItem::Kind::kTensor);
  EXPECT_EQ(uneven.dtype, DType::kFloat32);
  EXPECT_EQ(uneven.size, (std::vector<int64_t>{5, 7}));
  ASSERT_EQ(uneven.chunks.size(), 2u);
  EXPECT_EQ(uneven.chunks[1].offsets, (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(uneven.chunks[1].sizes, (std::vector<int64_t>{2, 7}));
  EXPECT_EQ(meta->items.at("w_col").chunks[1].offsets, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(meta->items.at("meta.step").kind, DcpItem::Kind::kBytes);
  const DcpStorage* step = meta->Find("meta.step", {});
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->relative_path, "__1_0.distcp");
  EXPECT_EQ(step->offset, 0u);
  EXPECT_EQ(step->length, 864u);
}

TEST(DcpMetadataTest, MegatronCoreSavesWithTheirOwnClasses) {
  // 0.14 pickles Megatron's MCoreSavePlan: read as an inert record.
  Result<DcpMetadata> v14 = ReadDcpMetadata((kData / "megatron-core/0.14/w2_tp2/.metadata").string());
  ASSERT_TRUE(v14.ok()) << v14.status().message();
  EXPECT_EQ(v14->items.size(), 24u);
  EXPECT_EQ(v14->storage.size(), 50u);
  Result<DcpMetadata> v19 = ReadDcpMetadata((kData / "megatron-core/0.19/w2_tp2_bf16/.metadata").string());
  ASSERT_TRUE(v19.ok()) << v19.status().message();
  EXPECT_EQ(v19->items.size(), 25u);
  const DcpItem& qkv = v19->items.at("decoder.layers.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv.dtype, DType::kBFloat16);
  EXPECT_EQ(qkv.size, (std::vector<int64_t>{2, 32, 16}));
  EXPECT_EQ(qkv.chunks.size(), 4u);  // one per layer and TP rank
  EXPECT_EQ(v19->items.at("decoder.layers.self_attention.linear_qkv.layer_norm_weight").dtype,
            DType::kFloat32);
}

// 0.14's fully_sharded_model_space records each optimizer state's original
// shape in mcore_data; the weights saved as they are record none.
TEST(DcpMetadataTest, MegatronCore014RecordsTheReformulatedStatesOriginalShapes) {
  Result<DcpMetadata> meta = ReadDcpMetadata(
      (kData / "megatron-core/0.14/w2_tp2_optim_fully_sharded_model_space/.metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  const auto& shapes = meta->nd_reformulated_orig_shapes;
  EXPECT_EQ(shapes.size(), 3u * 16);  // three states of 16 keys
  const std::string qkv = "optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight";
  EXPECT_EQ(shapes.at(qkv), (std::vector<int64_t>{2, 32, 16}));
  EXPECT_EQ(meta->items.at(qkv).size, (std::vector<int64_t>{2, 2, 1, 256}));
  EXPECT_EQ(shapes.at("optimizer.state.exp_avg.decoder.final_layernorm.weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(shapes.count("decoder.layers.self_attention.linear_qkv.weight"), 0u);
  Result<DcpMetadata> v19 = ReadDcpMetadata((kData / "megatron-core/0.19/w2_tp2_optim_fully_reshardable/.metadata").string());
  ASSERT_TRUE(v19.ok()) << v19.status().message();
  EXPECT_TRUE(v19->nd_reformulated_orig_shapes.empty());
}

// Expects the contiguous `chunk` to equal the box at `offsets` of `full`.
void ExpectBoxOf(const Tensor& full, const Tensor& chunk, const std::vector<int64_t>& offsets) {
  const int esize = ElementSize(chunk.storage->dtype);
  ASSERT_EQ(full.storage->dtype, chunk.storage->dtype);
  ASSERT_EQ(full.sizes.size(), chunk.sizes.size());
  std::vector<int64_t> index(chunk.sizes.size(), 0);
  for (int64_t i = 0; i < chunk.numel(); ++i) {
    int64_t at = full.storage_offset;
    for (size_t d = 0; d < index.size(); ++d) at += (offsets[d] + index[d]) * full.strides[d];
    const uint8_t* want = full.storage->bytes.data + at * esize;
    const uint8_t* got = chunk.storage->bytes.data + (chunk.storage_offset + i) * esize;
    ASSERT_EQ(std::memcmp(want, got, esize), 0) << "element " << i;
    for (size_t d = index.size(); d-- > 0;) {  // the next index, last dimension fastest
      if (++index[d] < chunk.sizes[d]) break;
      index[d] = 0;
    }
  }
}

// Every chunk of every tensor of `folder` against the whole tensors of `full`.
void ExpectChunksMatch(const fs::path& folder, const Value& tensors) {
  Result<DcpMetadata> meta = ReadDcpMetadata((folder / ".metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  int compared = 0;
  for (const auto& [fqn, item] : meta->items) {
    if (item.kind != DcpItem::Kind::kTensor) continue;
    const Value* whole = Find(tensors, fqn);
    ASSERT_NE(whole, nullptr) << fqn;
    for (const Box& c : item.chunks) {
      Result<std::shared_ptr<const MappedFile>> file =
          MappedFile::Open((folder / meta->Find(fqn, c.offsets)->relative_path).string());
      ASSERT_TRUE(file.ok()) << file.status().message();
      Result<Value> chunk = ReadDcpChunk(*file, *meta, fqn, c);
      ASSERT_TRUE(chunk.ok()) << chunk.status().message();
      SCOPED_TRACE(fqn);
      ExpectBoxOf(whole->as_tensor(), chunk->as_tensor(), c.offsets);
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
}

TEST(DcpMetadataTest, ChunksEqualTheWholeTensorsTorchLoaded) {
  Result<Value> full = ReadTorchFile((kData / "dcp/world2_dtensor_full.pt").string());
  ASSERT_TRUE(full.ok()) << full.status().message();
  ExpectChunksMatch(kData / "dcp/world2_dtensor", *Find(*full, "tensors"));
  for (const char* tag : {"w2_tp2", "w2_tp2_bf16", "w2_pp2", "w2_tp2_swiglu"}) {
    SCOPED_TRACE(tag);
    Result<Value> whole =
        ReadTorchFile((kData / "megatron-core/0.19" / (std::string(tag) + "_full.pt")).string());
    ASSERT_TRUE(whole.ok()) << whole.status().message();
    ExpectChunksMatch(kData / "megatron-core/0.19" / tag, *whole);
  }
}

TEST(DcpMetadataTest, BytesItemIsThePlainObject) {
  const fs::path folder = kData / "dcp/world2_dtensor";
  Result<DcpMetadata> meta = ReadDcpMetadata((folder / ".metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  const DcpStorage* step = meta->Find("meta.step", {});
  ASSERT_NE(step, nullptr);
  Result<std::shared_ptr<const MappedFile>> file = MappedFile::Open((folder / step->relative_path).string());
  ASSERT_TRUE(file.ok());
  Result<Value> value = ReadDcpItem(*file, *step);
  ASSERT_TRUE(value.ok()) << value.status().message();
  ASSERT_TRUE(value->is(Value::Kind::kInt));
  EXPECT_EQ(value->as_int(), 10);  // world2_dtensor_full.pt: objects['meta.step']
}

// ---- Malformed files --------------------------------------------------------------

Value Record(const std::string& cls, Items state) {
  Object o;
  const size_t dot = cls.rfind('.');
  o.cls = Global{cls.substr(0, dot), cls.substr(dot + 1)};
  o.construct = Object::Construct::kNewObj;
  o.state = std::make_shared<Value>(Value::MakeDict(std::move(state)));
  return Value::MakeObject(std::move(o));
}

const std::string kMeta = "torch.distributed.checkpoint.metadata.";

// A one-tensor Metadata: `size`, one chunk, its storage entry unless `stored`
// is false, and the dtype `dtype` (a torch global's name).
// A `.metadata` of one float tensor `w` of `size` cut into `chunks`, each
// stored (when `stored`) in `file`.
Value OneTensorMetadata(std::vector<int64_t> size, std::vector<Box> chunks, bool stored,
                        const std::string& dtype = "float32", const std::string& file = "__0_0.distcp") {
  Value props = Record(kMeta + "TensorProperties", {});
  props.as_object().state = std::make_shared<Value>(Value::MakeTuple(
      {Value::MakeGlobal(Global{"torch", dtype}), Value::Bool(false)}));
  std::vector<Value> listed;
  Items storage;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Box& chunk = chunks[i];
    listed.push_back(Record(kMeta + "ChunkStorageMetadata", {{Value::String("offsets"), MakeTorchSize(chunk.offsets)},
                                                             {Value::String("sizes"), MakeTorchSize(chunk.sizes)}}));
    if (!stored) continue;
    Value key = Record(kMeta + "MetadataIndex", {{Value::String("fqn"), Value::String("w")},
                                                 {Value::String("offset"), MakeTorchSize(chunk.offsets)},
                                                 {Value::String("index"), Value::Int(static_cast<int64_t>(i))}});
    Value where = Record("torch.distributed.checkpoint.filesystem._StorageInfo",
                         {{Value::String("relative_path"), Value::String(file)},
                          {Value::String("offset"), Value::Int(static_cast<int64_t>(100 * i))},
                          {Value::String("length"), Value::Int(100)}});
    storage.push_back({key, where});
  }
  Value tensor = Record(kMeta + "TensorStorageMetadata",
                        {{Value::String("properties"), props},
                         {Value::String("size"), MakeTorchSize(size)},
                         {Value::String("chunks"), Value::MakeList(std::move(listed))}});
  return Record(kMeta + "Metadata",
                {{Value::String("state_dict_metadata"), Value::MakeDict({{Value::String("w"), tensor}})},
                 {Value::String("storage_data"), Value::MakeDict(std::move(storage))}});
}

// The error ReadDcpMetadata gives for `bytes` written as a .metadata file.
std::string ErrorFor(const TempDir& dir, const std::string& bytes) {
  const std::string path = (dir.path() / ".metadata").string();
  std::ofstream(path, std::ios::binary) << bytes;
  Result<DcpMetadata> meta = ReadDcpMetadata(path);
  if (meta.ok()) return "(read without error)";
  const std::string& message = meta.status().message();
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_EQ(message.rfind(path, 0), 0u) << message;  // names the file first
  return message;
}

std::string Pickled(const Value& root) {
  Result<std::string> bytes = WritePickle(root, nullptr);
  EXPECT_TRUE(bytes.ok()) << bytes.status().message();
  return bytes.ok() ? *bytes : "";
}

TEST(DcpMetadataTest, WellFormedSyntheticFileReads) {
  TempDir dir;
  EXPECT_EQ(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {3, 7}}, {{3, 0}, {2, 7}}}, true))),
            "(read without error)");
}

TEST(DcpMetadataTest, MalformedFilesGiveOneLineErrors) {
  TempDir dir;
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{3, 0}, {3, 7}}}, true))).find("outside"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0}, {5}}}, true))).find("outside"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, false)))
                .find("no storage entry for the chunk of 'w' at [0, 0]"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true, "float8_e4m3fn")))
                .find("does not know"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true, "float32", "../x")))
                .find("not a file name"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {3, 7}}, {{2, 0}, {3, 7}}}, true)))
                .find("tensor 'w' has chunks at [0, 0] and [2, 0] that overlap"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(OneTensorMetadata({5, 7}, {{{3, 0}, {2, 7}}}, true)))
                .find("has chunks holding 14 of its 35 elements"),
            std::string::npos);
  EXPECT_NE(ErrorFor(dir, Pickled(Value::MakeDict())).find("not a torch.distributed.checkpoint Metadata"),
            std::string::npos);
  const std::string whole = Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true));
  EXPECT_NE(ErrorFor(dir, whole.substr(0, whole.size() / 2)), "(read without error)");
  EXPECT_NE(ErrorFor(dir, ""), "(read without error)");
}

// `meta` with `planner_data` added to its fields.
Value WithPlannerData(Value meta, Value planner_data) {
  Set(meta, "planner_data", std::move(planner_data));
  return meta;
}

TEST(DcpMetadataTest, OnlyMegatronsClassesAreInert) {
  TempDir dir;
  const Value meta = OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true);
  EXPECT_EQ(ErrorFor(dir, Pickled(WithPlannerData(
                              meta, Record("megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan", {})))),
            "(read without error)");
  Object call;
  call.cls = Global{"posix", "system"};
  call.args = {Value::String("touch pwned")};
  const std::string gadget = ErrorFor(dir, Pickled(WithPlannerData(meta, Value::MakeObject(std::move(call)))));
  EXPECT_NE(gadget.find("pickle refers to class 'posix.system', which reshard does not know"), std::string::npos)
      << gadget;
}

TEST(DcpMetadataTest, AnItemListedTwiceIsNamed) {
  TempDir dir;
  Value meta = OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true);
  Items& items = *MutableDictItems(*FindMutable(meta, "state_dict_metadata"));
  items.push_back(items[0]);
  EXPECT_NE(ErrorFor(dir, Pickled(meta)).find("lists item 'w' twice"), std::string::npos);
}

TEST(DcpMetadataTest, EmptyAndTruncatedFilesSaySo) {
  TempDir dir;
  EXPECT_NE(ErrorFor(dir, "").find(".metadata is empty; it is not a readable Distributed Checkpoint"),
            std::string::npos);
  const std::string whole = Pickled(OneTensorMetadata({5, 7}, {{{0, 0}, {5, 7}}}, true));
  const std::string cut = ErrorFor(dir, whole.substr(0, 100));
  EXPECT_NE(cut.find(".metadata (100 bytes): malformed pickle"), std::string::npos) << cut;
  EXPECT_NE(cut.find("not a readable Distributed Checkpoint .metadata file"), std::string::npos) << cut;
}

TEST(DcpMetadataTest, TruncatedRealFileGivesOneLineError) {
  std::ifstream in(kData / "megatron-core/0.14/w2_tp2/.metadata", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TempDir dir;
  EXPECT_NE(ErrorFor(dir, bytes.substr(0, bytes.size() - 10)), "(read without error)");
}

}  // namespace
}  // namespace reshard
