// What the torch_dist and Megatron-LM imports share about the run: the
// tracker a Megatron-LM root names its iteration in (dcp_common, which the
// DCP reader follows too), and the run state.
#include "formats/megatron_core/common/torch_dist_family.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

#include "formats/dcp_common/megatron_tracker.h"
#include "test_util.h"

namespace reshard {
namespace {

std::string TrackedBy(const TempDir& dir, const std::string& text) {
  std::ofstream(dir.path() / "latest_checkpointed_iteration.txt") << text;
  Result<std::string> folder = MegatronTrackedFolder(dir.path().string());
  return folder.ok() ? *folder : "error: " + folder.status().message();
}

TEST(MegatronTrackedFolderTest, NamesTheIterationsFolder) {
  TempDir dir;
  EXPECT_EQ(MegatronTrackedFolder(dir.path().string()).value(), "");  // no tracker
  EXPECT_EQ(TrackedBy(dir, "10\n"), "iter_0000010");
  EXPECT_EQ(TrackedBy(dir, "123456789"), "iter_123456789");
  EXPECT_EQ(TrackedBy(dir, " release\n"), "release");
}

TEST(MegatronTrackedFolderTest, RefusesWhatNamesNoIteration) {
  TempDir dir;
  const std::string path = (dir.path() / "latest_checkpointed_iteration.txt").string();
  for (const std::string& text : {"../../../etc", "-1", "10000000000000000000000000000000000000000", "", "1e3",
                                  "10 20"}) {
    const std::string message = TrackedBy(dir, text);
    EXPECT_EQ(message.rfind("error: " + path + " holds '", 0), 0u) << text << ": " << message;
    EXPECT_NE(message.find("not an iteration number or 'release'"), std::string::npos) << message;
  }
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const Result<std::string> fifo = MegatronTrackedFolder(dir.path().string());
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find(path + " is a FIFO"), std::string::npos) << fifo.status().message();
}

TEST(CheckRunStateTest, ArgsAndIterationMustBeWhatMegatronSaves) {
  EXPECT_TRUE(CheckRunState(Value::MakeDict(), "f").ok());
  EXPECT_TRUE(CheckRunState(Value::MakeDict({{Value::String("args"), MakeNamespace({})},
                                             {Value::String("iteration"), Value::Int(3)}}),
                            "f")
                  .ok());
  EXPECT_EQ(CheckRunState(Value::MakeList({}), "f").message(), "f holds [], not the dict Megatron saves");
  EXPECT_EQ(CheckRunState(Value::MakeDict({{Value::String("args"), Value::Int(7)}}), "f").message(),
            "f holds args 7, not an argparse.Namespace");
  EXPECT_EQ(CheckRunState(Value::MakeDict({{Value::String("iteration"), Value::String("x")}}), "f").message(),
            "f holds the iteration 'x', not an int");
}

}  // namespace
}  // namespace reshard
