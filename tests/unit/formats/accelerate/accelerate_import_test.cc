// Which folder is an Accelerate FSDP checkpoint: checkpoint-N/ itself, or
// its model's or optimizer's DCP folder passed for it; the FULL_STATE_DICT
// form refused; the ranks' RNG states told from the rest of the run state.
#include "formats/accelerate/accelerate_import.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <unistd.h>

namespace reshard {
namespace {

namespace fs = std::filesystem;

class AccelerateFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("reshard-accelerate-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "checkpoint-2" / kAccelerateModelFolder);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Folder(const std::string& rest = "") const {
    return (root_ / "checkpoint-2" / rest).lexically_normal().string();
  }
  void Touch(const std::string& rest) const { std::ofstream(Folder(rest)) << "x"; }

  fs::path root_;
};

TEST_F(AccelerateFolderTest, TheCheckpointFolderOrItsDcpFolders) {
  const std::string ckpt = (root_ / "checkpoint-2").string();
  EXPECT_EQ(*AccelerateCheckpointFolder(ckpt), ckpt);
  EXPECT_EQ(*AccelerateCheckpointFolder(ckpt + "/"), ckpt);
  // The model's folder alone is a plain DCP folder until its checkpoint shows it is Accelerate's.
  EXPECT_EQ(*AccelerateCheckpointFolder(Folder(kAccelerateModelFolder)), "");
  Touch(kTrainerStateFile);
  EXPECT_EQ(*AccelerateCheckpointFolder(Folder(kAccelerateModelFolder)), ckpt);
  EXPECT_EQ(*AccelerateCheckpointFolder(Folder(kAccelerateOptimizerFolder)), "");  // none there
  fs::create_directories(Folder(kAccelerateOptimizerFolder));
  EXPECT_EQ(*AccelerateCheckpointFolder(Folder(kAccelerateOptimizerFolder)), ckpt);
  EXPECT_EQ(*AccelerateCheckpointFolder(root_.string()), "");
}

TEST_F(AccelerateFolderTest, TheFullStateDictFormIsACheckpointFolder) {
  EXPECT_FALSE(IsAccelerateFullStateDict(Folder()));
  fs::remove_all(Folder(kAccelerateModelFolder));
  Touch("pytorch_model_fsdp.bin");
  Touch("optimizer.bin");
  Touch("trainer_state.json");
  Result<std::string> folder = AccelerateCheckpointFolder(Folder());
  ASSERT_TRUE(folder.ok()) << folder.status().message();
  EXPECT_EQ(*folder, (root_ / "checkpoint-2").string());
  EXPECT_TRUE(IsAccelerateFullStateDict(Folder()));
  // Its model and optimizer files are the checkpoint, not the Trainer's run state.
  EXPECT_EQ(AccelerateRunFiles(Folder()), std::vector<std::string>{"trainer_state.json"});
}

TEST_F(AccelerateFolderTest, RunFilesAreWhatTheTrainerSavedBesideTheFolders) {
  for (const char* name : {"trainer_state.json", "scheduler.pt", "rng_state_1.pth", "rng_state_0.pth", "config.json",
                           "reshard-manifest.json"}) {
    Touch(name);
  }
  EXPECT_EQ(AccelerateRunFiles(Folder()),
            (std::vector<std::string>{"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"}));
  EXPECT_TRUE(IsRankRngState("rng_state_12.pth"));
  EXPECT_TRUE(IsRankRngState("rng_state.pth"));
  EXPECT_FALSE(IsRankRngState("rng_state_x.pth"));
  EXPECT_FALSE(IsRankRngState("scheduler.pt"));
}

}  // namespace
}  // namespace reshard
