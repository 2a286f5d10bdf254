// OutputPlan and its writer: any plan, whatever format made it, lists its
// files and tensors for the dry run and is written by the same jobs, each
// container read back as written.
#include "exec/plan_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "container/safetensors_reader.h"
#include "container/torch_file.h"
#include "test_util.h"

namespace reshard {
namespace {

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

}  // namespace
}  // namespace reshard
