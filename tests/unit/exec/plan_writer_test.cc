// OutputPlan and its writer: any plan, whatever format made it, lists its
// files and tensors for the dry run and is written by the same jobs, each
// container read back as written.
#include "exec/plan_writer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "container/dcp_item.h"
#include "container/safetensors_reader.h"
#include "container/torch_file.h"
#include "test_util.h"
#include "util/shape.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// Float32 elements start, start + 1, ... produced on demand.
ByteProducer Counting(float start) {
  return [start](int64_t offset, int64_t length, uint8_t* dst) {
    for (int64_t at = 0; at < length; at += 4) {
      const float v = start + static_cast<float>((offset + at) / 4);
      std::memcpy(dst + at, &v, 4);
    }
    return Status::Ok();
  };
}

std::vector<float> Floats(const Value& tensor) {
  const Tensor& t = tensor.as_tensor();
  std::vector<float> out(static_cast<size_t>(t.numel()));
  std::memcpy(out.data(), t.storage->bytes.data + t.storage_offset * 4, out.size() * 4);
  return out;
}

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs every job into `dir` through a small buffer, collecting digests.
std::map<std::string, int> RunAll(const OutputPlan& plan, const std::string& dir) {
  std::map<std::string, int> pieces;
  std::vector<uint8_t> buffer(12);
  JobContext ctx{dir, buffer, [](int64_t) {},
                 [&pieces](const std::string& name, const FileDigest&) { ++pieces[name]; }};
  for (Job& job : PlanJobs(plan)) EXPECT_TRUE(job.run(ctx).ok()) << job.name;
  return pieces;
}

OutputPlan SamplePlan(const std::string& copied_from) {
  OutputPlan plan;
  plan.summary = "target: a sample\n";
  Items items;
  items.emplace_back(Value::String("w"), MakeProducedTensor(DType::kFloat32, {2, 3}, Counting(0)));
  Value nested = Value::MakeDict();
  Set(nested, "b", MakeProducedTensor(DType::kFloat32, {4}, Counting(100)));
  Set(nested, "step", Value::Int(7));
  items.emplace_back(Value::String("state"), std::move(nested));
  Result<PlannedFile> torch = TorchFile("sub/model.pt", "a model", Value::MakeDict(std::move(items)));
  EXPECT_TRUE(torch.ok());
  SetFrom(&*torch, "state/b", "counted from 100");
  plan.files.push_back(std::move(*torch));

  std::vector<SafetensorsTensor> tensors = {{"x", DType::kFloat32, {3}, Counting(10)},
                                            {"y", DType::kFloat32, {5}, Counting(20)}};
  auto content = std::make_shared<SafetensorsContent>();
  content->layout = *LayOutSafetensors(tensors, {});
  content->cuts = {0, content->layout.offsets[1], content->layout.size};  // two jobs
  content->tensors = std::move(tensors);
  PlannedFile safetensors;
  safetensors.name = "model.safetensors";
  safetensors.container = PlannedFile::Container::kSafetensors;
  safetensors.bytes = 32;
  safetensors.tensors = {{"x", DType::kFloat32, {3}, ""}, {"y", DType::kFloat32, {5}, ""}};
  safetensors.safetensors = std::move(content);
  plan.files.push_back(std::move(safetensors));

  plan.files.push_back(TextFile("note.txt", "hello"));
  plan.files.push_back(CopiedFile("copy.txt", copied_from, false));
  return plan;
}

TEST(OutputPlanTest, TorchFileListsAndSizesItsTensors) {
  TempDir dir;
  const OutputPlan plan = SamplePlan((dir.path() / "none").string());
  const PlannedFile& f = plan.files[0];
  EXPECT_EQ(f.bytes, 40);
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].key, "w");
  EXPECT_EQ(f.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.tensors[1].key, "state/b");
  EXPECT_EQ(f.tensors[1].from, "counted from 100");
}

TEST(OutputPlanTest, PlanTextListsEveryFileAndWithDetailEveryTensor) {
  const OutputPlan plan = SamplePlan("/src/copied.txt");
  const std::string brief = PlanText(plan, false);
  EXPECT_EQ(brief.rfind("target: a sample\n  sub/model.pt  a model, 2 tensors, 0.0 KiB", 0), 0u) << brief;
  EXPECT_NE(brief.find("  model.safetensors  2 tensors, 0.0 KiB\n"), std::string::npos) << brief;
  EXPECT_NE(brief.find("  note.txt  text\n"), std::string::npos) << brief;
  EXPECT_NE(brief.find("  copy.txt  copy of /src/copied.txt\n"), std::string::npos) << brief;
  EXPECT_NE(brief.find("total: 4 files, 0.1 KiB of tensors\n"), std::string::npos) << brief;
  EXPECT_EQ(brief.find("state/b"), std::string::npos);
  const std::string detail = PlanText(plan, true);
  EXPECT_NE(detail.find("    state/b float32[4]: counted from 100\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("    w float32[2, 3]\n"), std::string::npos) << detail;
}

TEST(PlanWriterTest, WritesEveryContainerAsPlanned) {
  TempDir src, out;
  std::ofstream(src.path() / "copied.txt") << "copied bytes";
  const OutputPlan plan = SamplePlan((src.path() / "copied.txt").string());
  const std::vector<Job> jobs = PlanJobs(plan);
  ASSERT_EQ(jobs.size(), 5u);  // the safetensors file as two ranges
  EXPECT_EQ(jobs[1].name, "model.safetensors");
  EXPECT_EQ(jobs[2].part, 1);

  const std::map<std::string, int> pieces = RunAll(plan, out.path().string());
  EXPECT_EQ(pieces.at("model.safetensors"), 2);
  EXPECT_EQ(pieces.at("sub/model.pt"), 1);

  Result<Value> model = ReadTorchFile((out.path() / "sub/model.pt").string());
  ASSERT_TRUE(model.ok()) << model.status().message();
  EXPECT_EQ(Floats(*Find(*model, "w")), (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(Floats(*Find(*Find(*model, "state"), "b")), (std::vector<float>{100, 101, 102, 103}));
  EXPECT_EQ(Find(*Find(*model, "state"), "step")->as_int(), 7);

  Result<SafetensorsFile> st = ReadSafetensors((out.path() / "model.safetensors").string());
  ASSERT_TRUE(st.ok()) << st.status().message();
  ASSERT_EQ(st->tensors.size(), 2u);
  EXPECT_EQ(Floats(st->tensors[1].second), (std::vector<float>{20, 21, 22, 23, 24}));

  EXPECT_EQ(ReadText(out.path() / "note.txt"), "hello");
  EXPECT_EQ(ReadText(out.path() / "copy.txt"), "copied bytes");
}

// A tensor chunk whose element i of the whole tensor is i * scale + shift.
DcpWriteItem Pattern(const std::string& fqn, DType dtype, std::vector<int64_t> size, Box chunk, double scale,
                     double shift) {
  ByteProducer produce = PatternProducer(dtype, size, Box{chunk.offsets, chunk.sizes}, scale, shift);
  return DcpTensorItem(fqn, dtype, std::move(size), std::move(chunk), std::move(produce));
}

// A Distributed Checkpoint of two data files in `folder`, the first written
// as several runs of items. tests/interop/test_dcp_write_torch2.py loads it
// with torch 2.6 and expects these very values.
OutputPlan DcpPlan(const std::string& folder, const DcpWriteOptions& options = {}) {
  std::vector<DcpWriteItem> rank0, rank1;
  rank0.push_back(Pattern("w_uneven", DType::kFloat32, {5, 7}, {{0, 0}, {3, 7}}, 1, 0));
  rank1.push_back(Pattern("w_uneven", DType::kFloat32, {5, 7}, {{3, 0}, {2, 7}}, 1, 0));
  rank0.push_back(Pattern("w_col", DType::kBFloat16, {6, 10}, {{0, 0}, {6, 5}}, 1, -30));
  rank1.push_back(Pattern("w_col", DType::kBFloat16, {6, 10}, {{0, 5}, {6, 5}}, 1, -30));
  rank0.push_back(Pattern("cube", DType::kFloat32, {2, 3, 4}, {{0, 0, 0}, {2, 3, 2}}, 0.25, 0));
  rank1.push_back(Pattern("cube", DType::kFloat32, {2, 3, 4}, {{0, 0, 2}, {2, 3, 2}}, 0.25, 0));
  rank0.push_back(Pattern("half", DType::kFloat16, {3, 4}, {{0, 0}, {3, 4}}, 0.5, 0));
  rank1.push_back(Pattern("ids", DType::kInt64, {4}, {{0}, {4}}, double(int64_t{1} << 40), -1e12));
  rank1.push_back(Pattern("scalar", DType::kFloat32, {}, {{}, {}}, 1, 2.5));
  rank0.push_back(DcpBytesItem("step", Value::Int(7)));
  DcpWriteItem lr = DcpBytesItem("optim.lr", Value::Float(0.001));
  lr.path = {Value::String("optim"), Value::String("lr")};  // saved from a nested dict
  rank1.push_back(std::move(lr));
  Value note = Value::MakeDict();
  Set(note, "list", Value::MakeList({Value::Int(1), Value::Float(2.5), Value::String("x"), Value(),
                                     Value::MakeTuple({Value::Int(3), Value::Int(4)})}));
  rank1.push_back(DcpBytesItem("note", std::move(note)));

  OutputPlan plan;
  plan.summary = "target: a Distributed Checkpoint\n";
  plan.files.push_back(DcpDataFile(folder, "rank 0", *LayOutDcpFile("__0_0.distcp", std::move(rank0), options), 1500));
  plan.files.push_back(DcpDataFile(folder, "rank 1", *LayOutDcpFile("__1_0.distcp", std::move(rank1), options), 1 << 20));
  SetFrom(&plan.files[0], "w_uneven[0:3, 0:7]", "arange");
  Result<PlannedFile> metadata = DcpMetadataFile(folder, {&plan.files[0], &plan.files[1]});
  EXPECT_TRUE(metadata.ok()) << metadata.status().message();
  plan.files.push_back(std::move(*metadata));
  return plan;
}

TEST(OutputPlanTest, PlanTextListsEveryDcpItem) {
  const OutputPlan plan = DcpPlan("ckpt");
  const std::string detail = PlanText(plan, true);
  EXPECT_NE(detail.find("  ckpt/__0_0.distcp  rank 0, 4 tensors, "), std::string::npos) << detail;
  EXPECT_NE(detail.find("    w_uneven[0:3, 0:7] float32[3, 7]: arange\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("    cube[0:2, 0:3, 2:4] float32[2, 3, 2]\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("    half float16[3, 4]\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("    scalar float32[]\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("    step: 7\n"), std::string::npos) << detail;
  EXPECT_NE(detail.find("  ckpt/.metadata  Distributed Checkpoint metadata of 12 items\n"), std::string::npos)
      << detail;
}

TEST(PlanWriterTest, WritesADistributedCheckpointThatReadsBackBitForBit) {
  TempDir out;
  const OutputPlan plan = DcpPlan("ckpt");
  const std::vector<Job> jobs = PlanJobs(plan);
  ASSERT_GT(plan.files[0].dcp->cuts.size(), 2u);  // runs of items
  EXPECT_EQ(jobs.size(), plan.files[0].dcp->cuts.size() - 1 + 2);
  const std::map<std::string, int> pieces = RunAll(plan, out.path().string());
  EXPECT_EQ(pieces.at("ckpt/__0_0.distcp"), static_cast<int>(plan.files[0].dcp->cuts.size() - 1));

  const fs::path folder = out.path() / "ckpt";
  Result<DcpMetadata> meta = ReadDcpMetadata((folder / ".metadata").string());
  ASSERT_TRUE(meta.ok()) << meta.status().message();
  EXPECT_EQ(meta->items.size(), 9u);
  int chunks = 0;
  for (const PlannedFile* f : {&plan.files[0], &plan.files[1]}) {
    const DcpFileLayout& layout = f->dcp->layout;
    EXPECT_EQ(fs::file_size(folder / layout.name), layout.size);
    auto file = MappedFile::Open((folder / layout.name).string());
    ASSERT_TRUE(file.ok());
    for (const DcpWriteItem& item : layout.items) {
      if (item.kind == DcpItem::Kind::kBytes) continue;
      SCOPED_TRACE(item.fqn);
      Result<Value> chunk = ReadDcpChunk(*file, *meta, item.fqn, item.chunk);
      ASSERT_TRUE(chunk.ok()) << chunk.status().message();
      const Tensor& t = chunk->as_tensor();
      std::string want(static_cast<size_t>(ShapeNumel(item.chunk.sizes) * ElementSize(item.dtype)), '\0');
      ASSERT_TRUE(item.produce(0, static_cast<int64_t>(want.size()), reinterpret_cast<uint8_t*>(want.data())).ok());
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(t.storage->bytes.data), want.size()), want);
      ++chunks;
    }
  }
  EXPECT_EQ(chunks, 9);
}

// Not a test by itself: tests/interop/test_dcp_write_torch2.py runs it with
// RESHARD_DCP_WRITE_DIR set, then has torch 2.6 load what it wrote: `dcp`,
// and `dcp_zip64`, the same with every tensor record a ZIP64 one.
TEST(PlanWriterTest, WritesADistributedCheckpointForTorch) {
  const char* dir = std::getenv("RESHARD_DCP_WRITE_DIR");
  if (dir == nullptr) GTEST_SKIP() << "RESHARD_DCP_WRITE_DIR is not set";
  RunAll(DcpPlan("dcp"), dir);
  DcpWriteOptions zip64;
  zip64.zip64_threshold = 16;
  RunAll(DcpPlan("dcp_zip64", zip64), dir);
}

}  // namespace
}  // namespace reshard
