#include "formats/deepspeed/files/checkpoint_files.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "test_util.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

void Touch(const fs::path& p, const std::string& content = "") {
  std::ofstream(p) << content;
}

TEST(CheckpointFilesTest, MoeFamiliesAreParsedAndSorted) {
  TempDir dir;
  for (const char* name : {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                           "layer_0_expert_3_mp_rank_01_model_states.pt", "layer_12_expert_0_mp_rank_00_model_states.pt",
                           "expert_7_mp_rank_00_model_states.pt", "expp_rank_1_mp_rank_01_optim_states.pt",
                           "zero_pp_rank_0_mp_rank_00_optim_states.pt"}) {
    Touch(dir.path() / name);
  }
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->IsMoe());
  EXPECT_TRUE(r->other_files.empty());
  EXPECT_EQ(BaseName(r->expert_files.at(1).at(0).at(3)), "layer_0_expert_3_mp_rank_01_model_states.pt");
  EXPECT_EQ(BaseName(r->expert_files.at(0).at(12).at(0)), "layer_12_expert_0_mp_rank_00_model_states.pt");
  EXPECT_EQ(BaseName(r->expert_files.at(0).at(-1).at(7)), "expert_7_mp_rank_00_model_states.pt");
  EXPECT_EQ(BaseName(r->expert_optimizer_files.at(1).at(1)), "expp_rank_1_mp_rank_01_optim_states.pt");
  EXPECT_EQ(r->optimizer_files.size(), 1u);  // expp_rank files are not ZeRO shards
  EXPECT_EQ(r->Paths().size(), 7u);
}

TEST(CheckpointFilesTest, MoeNamesRoundTrip) {
  for (const std::string name : {"layer_1_expert_13_mp_rank_02_model_states.pt", "expert_4_mp_rank_00_model_states.pt",
                                 "expp_rank_3_mp_rank_100_optim_states.pt"}) {
    EXPECT_EQ(RankFileName(ParseDeepSpeedFileName(name)), name);
  }
  EXPECT_EQ(ParseDeepSpeedFileName("layer_01-model_00-model_states.pt").kind, DeepSpeedFileName::Kind::kLayer);
}

TEST(CheckpointFilesTest, TwoSpellingsOfOneExpertFileAreRefused) {
  TempDir dir;
  Touch(dir.path() / "mp_rank_00_model_states.pt");
  Touch(dir.path() / "layer_0_expert_1_mp_rank_00_model_states.pt");
  Touch(dir.path() / "layer_0_expert_1_mp_rank_000_model_states.pt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("which are the same rank file (layer_0_expert_1_mp_rank_00_model_states.pt)"),
            std::string::npos)
      << r.status().message();
}

TEST(CheckpointFilesTest, BogusPathIsNamed) {
  Result<CheckpointFiles> r = ScanCheckpoint("/nonexistent/ckpt");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
  EXPECT_EQ(r.status().message(), "no such checkpoint folder: /nonexistent/ckpt");
}

TEST(CheckpointFilesTest, FileInsteadOfFolder) {
  TempDir dir;
  Touch(dir.path() / "x.pt");
  Result<CheckpointFiles> r = ScanCheckpoint((dir.path() / "x.pt").string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is a file; pass a checkpoint tag folder"), std::string::npos);
}

TEST(CheckpointFilesTest, EmptyFolder) {
  TempDir dir;
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is an empty folder"), std::string::npos);
}

// A root without `latest`: not a tag folder; its tag folders are what
// OpenCheckpoint's refusal names (formats/folder_hint.h).
TEST(CheckpointFilesTest, NoMpRankFilesIsNotATagFolderAndItsTagFoldersAreListed) {
  TempDir dir;
  for (const char* tag : {"global_step9", "global_step10"}) {
    fs::create_directory(dir.path() / tag);
    Touch(dir.path() / tag / "mp_rank_00_model_states.pt");
  }
  fs::create_directory(dir.path() / "logs");
  Touch(dir.path() / "notes.txt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("has no mp_rank_*_model_states.pt files"), std::string::npos);
  EXPECT_EQ(TagFoldersIn(dir.path().string()), (std::vector<std::string>{"global_step10", "global_step9"}));
}

TEST(CheckpointFilesTest, LatestIsFollowed) {
  TempDir dir;
  fs::create_directory(dir.path() / "global_step7");
  Touch(dir.path() / "latest", "global_step7\n");
  Touch(dir.path() / "global_step7" / "mp_rank_00_model_states.pt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->tag, "global_step7");
}

TEST(CheckpointFilesTest, LatestNamingAMissingFolder) {
  TempDir dir;
  Touch(dir.path() / "latest", "global_step9");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("names 'global_step9', but there is no such folder"),
            std::string::npos);
}

// A tag is one folder inside the root; `latest` cannot point elsewhere.
TEST(CheckpointFilesTest, LatestNamingAPathIsRefused) {
  TempDir dir;
  fs::create_directory(dir.path() / "root");
  fs::create_directory(dir.path() / "root" / "sub");
  Touch(dir.path() / "mp_rank_00_model_states.pt");  // in the root's parent
  Touch(dir.path() / "root" / "mp_rank_00_model_states.pt");
  const std::vector<std::string> tags = {"..", ".", "../root", "sub/..", "/tmp", std::string("..\0x", 4)};
  for (const std::string& tag : tags) {
    Touch(dir.path() / "root" / "latest", tag + "\n");
    Result<CheckpointFiles> r = ScanCheckpoint((dir.path() / "root").string());
    ASSERT_FALSE(r.ok()) << tag << " accepted: " << r->tag_dir;
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
    EXPECT_NE(r.status().message().find("latest names '" + tag + "', which is not a tag folder name"),
              std::string::npos)
        << r.status().message();
  }
}

// Two names of one rank: one would silently replace the other.
TEST(CheckpointFilesTest, AliasedRankFilesAreRefused) {
  const std::vector<std::pair<std::string, std::string>> aliases = {
      {"mp_rank_00_model_states.pt", "mp_rank_000_model_states.pt"},
      {"layer_03-model_00-model_states.pt", "layer_003-model_00-model_states.pt"},
      {"layer_03-model_00-model_states.pt", "layer_3-model_000-model_states.pt"},
      {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_01_mp_rank_00_optim_states.pt"},
      {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"},
      {"zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_000_model_states.pt"},
  };
  for (const auto& [canonical, alias] : aliases) {
    TempDir dir;
    Touch(dir.path() / "mp_rank_00_model_states.pt");
    Touch(dir.path() / canonical);
    Touch(dir.path() / alias);
    Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
    ASSERT_FALSE(r.ok()) << alias;
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidInput);
    const auto [first, second] = std::minmax(canonical, alias);
    EXPECT_NE(r.status().message().find(" holds both " + first + " and " + second +
                                        ", which are the same rank file"),
              std::string::npos)
        << r.status().message();
  }
}

// Integers are parsed from names, never string-sorted: rank 100 follows 99.
TEST(CheckpointFilesTest, HundredsOfRanksParseAsIntegers) {
  TempDir dir;
  for (int m = 0; m < 120; ++m) {
    char name[64];
    std::snprintf(name, sizeof(name), "mp_rank_%02d_model_states.pt", m);
    Touch(dir.path() / name);
  }
  for (int l : {1, 100, 101}) {
    char name[64];
    std::snprintf(name, sizeof(name), "layer_%02d-model_00-model_states.pt", l);
    Touch(dir.path() / name);
  }
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->mp_rank_files.size(), 120u);
  EXPECT_EQ(r->mp_rank_files.rbegin()->first, 119);
  EXPECT_EQ(r->layer_files.rbegin()->first, 101);
  int tp, pp, dp;
  ASSERT_TRUE(CheckRankGrid(*r, &tp, &pp, &dp).ok());
  EXPECT_EQ(tp, 1);
  EXPECT_EQ(pp, 120);
  EXPECT_EQ(dp, 0);
}

TEST(CheckpointFilesTest, MissingRanksAreNamed) {
  TempDir dir;
  Touch(dir.path() / "mp_rank_00_model_states.pt");
  Touch(dir.path() / "mp_rank_02_model_states.pt");
  Touch(dir.path() / "mp_rank_03_model_states.pt");
  Touch(dir.path() / "layer_01-model_00-model_states.pt");
  Touch(dir.path() / "layer_01-model_01-model_states.pt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  ASSERT_TRUE(r.ok());
  int tp, pp, dp;
  Status st = CheckRankGrid(*r, &tp, &pp, &dp);
  EXPECT_EQ(st.message(), "mp_rank file(s) 1 of 4 are missing; the checkpoint is incomplete");
}

TEST(CheckpointFilesTest, MissingLayerTpRank) {
  TempDir dir;
  Touch(dir.path() / "mp_rank_00_model_states.pt");
  Touch(dir.path() / "mp_rank_01_model_states.pt");
  Touch(dir.path() / "layer_01-model_00-model_states.pt");
  Touch(dir.path() / "layer_01-model_01-model_states.pt");
  Touch(dir.path() / "layer_03-model_00-model_states.pt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  int tp, pp, dp;
  Status st = CheckRankGrid(*r, &tp, &pp, &dp);
  EXPECT_NE(st.message().find("layer 3 is missing TP rank file(s) 1"), std::string::npos);
}

TEST(CheckpointFilesTest, MissingOptimizerShard) {
  TempDir dir;
  Touch(dir.path() / "mp_rank_00_model_states.pt");
  Touch(dir.path() / "layer_01-model_00-model_states.pt");
  Touch(dir.path() / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt");
  Touch(dir.path() / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt");
  Result<CheckpointFiles> r = ScanCheckpoint(dir.path().string());
  int tp, pp, dp;
  Status st = CheckRankGrid(*r, &tp, &pp, &dp);
  EXPECT_NE(st.message().find("DP rank(s) 1 of mp_rank 0 are missing"), std::string::npos);
}

}  // namespace
}  // namespace reshard
