// Where reshard writes: --overwrite replaces only an earlier reshard output,
// pointer files go only into a root the user named, and a pointer naming
// another checkpoint is replaced only with --overwrite.
#include "exec/output_folder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "exec/manifest.h"
#include "test_util.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

void WriteText(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

// An earlier reshard output in `dir`: its files and the manifest listing them.
void WriteReshardOutput(const fs::path& dir) {
  Manifest manifest{"reshard", "", "", "", {}};
  for (const std::string name : {"latest_checkpointed_iteration.txt", "iter_0000010/mp_rank_00/model_optim_rng.pt"}) {
    WriteText(dir / name, "x");
    manifest.files[name] = FileDigest{1, 0};
  }
  WriteText(dir / kManifestName, ManifestJson(manifest));
}

// Runs a test body with the current folder set to `dir`.
class InFolder {
 public:
  explicit InFolder(const fs::path& dir) : before_(fs::current_path()) { fs::current_path(dir); }
  ~InFolder() { fs::current_path(before_); }

 private:
  const fs::path before_;
};

Publication LatestPublication(std::string output_subfolder = "") {
  Publication publication;
  publication.output_subfolder = std::move(output_subfolder);
  publication.pointers = {{"latest", std::nullopt}};
  publication.root_markers = {"latest"};
  return publication;
}

TEST(CheckOverwritable, AnEmptyFolderOrAnEarlierOutputMayBeReplaced) {
  TempDir tmp;
  EXPECT_TRUE(CheckOverwritable(tmp.path().string()).ok());
  WriteReshardOutput(tmp.path());
  const Status status = CheckOverwritable(tmp.path().string());
  EXPECT_TRUE(status.ok()) << status.message();
}

TEST(CheckOverwritable, AUsersFileIsNamed) {
  TempDir tmp;
  WriteReshardOutput(tmp.path());
  WriteText(tmp.path() / "notes.txt", "precious");
  fs::create_directories(tmp.path() / "projects");
  const Status status = CheckOverwritable(tmp.path().string());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("it holds notes.txt, which no reshard run wrote"), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("does not list it"), std::string::npos) << status.message();
}

TEST(CheckOverwritable, AFolderOrFileInsideAListedFolderIsNamed) {
  TempDir tmp;
  WriteReshardOutput(tmp.path());
  fs::create_directories(tmp.path() / "iter_0000010" / "mine");
  const Status status = CheckOverwritable(tmp.path().string());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("it holds iter_0000010/mine/,"), std::string::npos) << status.message();
}

TEST(CheckOverwritable, AFolderWithoutManifestIsRefused) {
  TempDir tmp;
  fs::create_directories(tmp.path() / "projects");
  WriteText(tmp.path() / "notes.txt", "precious");
  const Status status = CheckOverwritable(tmp.path().string());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("it holds notes.txt,"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("it has no reshard-manifest.json"), std::string::npos) << status.message();
}

TEST(OutputFolder, OverwriteReplacesOnlyAnEarlierOutput) {
  TempDir tmp;
  const fs::path out = tmp.path() / "out";
  WriteText(out / "notes.txt", "precious");
  EXPECT_FALSE(OutputFolder::Check(out.string(), {}, true).ok());
  EXPECT_TRUE(fs::exists(out / "notes.txt"));

  fs::remove(out / "notes.txt");
  WriteReshardOutput(out);
  Result<OutputFolder> folder = OutputFolder::Check(out.string(), {}, true);
  ASSERT_TRUE(folder.ok()) << folder.status().message();
  ASSERT_TRUE(folder->Begin().ok());
  WriteText(fs::path(folder->staging_dir()) / "new.pt", "y");
  WriteText(out / "added.txt", "during the run");  // the commit must not remove it
  const Status committed = folder->Commit();
  ASSERT_FALSE(committed.ok());
  EXPECT_NE(committed.message().find("added.txt"), std::string::npos) << committed.message();
  EXPECT_TRUE(fs::exists(out / "added.txt"));
  EXPECT_TRUE(fs::exists(out / "latest_checkpointed_iteration.txt"));
}

TEST(OutputFolder, OverwriteOfAnEarlierOutputExchangesIt) {
  TempDir tmp;
  const fs::path out = tmp.path() / "out";
  WriteReshardOutput(out);
  Result<OutputFolder> folder = OutputFolder::Check(out.string(), {}, true);
  ASSERT_TRUE(folder.ok()) << folder.status().message();
  ASSERT_TRUE(folder->Begin().ok());
  WriteText(fs::path(folder->staging_dir()) / "new.pt", "y");
  ASSERT_TRUE(folder->Commit().ok());
  EXPECT_TRUE(folder->kept().empty());
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(tmp.path())) names.push_back(entry.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"out"});
  EXPECT_TRUE(fs::exists(out / "new.pt"));
  EXPECT_FALSE(fs::exists(out / "iter_0000010"));
}

// Begins `out`, lets the interrupt remove the staging folder, puts a file
// back where the staging folder was (as a worker still running might), then
// commits: 0 when the interrupt named OUT alone and the commit was refused.
int CommitAfterAnInterrupt(const fs::path& out) {
  Result<OutputFolder> folder = OutputFolder::Check(out.string(), {}, false);
  if (!folder.ok() || !folder->Begin().ok()) return 2;
  if (RemoveStagingFolders() != std::vector<std::string>{out.string()}) return 3;  // names OUT, once
  WriteText(fs::path(folder->staging_dir()) / "late.pt", "y");
  const Status committed = folder->Commit();
  std::fprintf(stderr, "%s\n", committed.message().c_str());
  return committed.ok() ? 1 : 0;
}

// A commit racing the interrupt (the main thread against the signal's) must
// not publish a staging folder whose files are being removed. In a child
// process: the interrupt is the whole process's.
TEST(OutputFolder, NothingIsPublishedOnceInterrupted) {
  TempDir tmp;
  const fs::path out = tmp.path() / "out";
  EXPECT_EXIT(std::exit(CommitAfterAnInterrupt(out)), ::testing::ExitedWithCode(0),
              "interrupted before .*out was published");
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(fs::is_empty(tmp.path()));
}

TEST(PlaceOutput, ARootGivenAsOutGetsTheTagAndThePointers) {
  TempDir tmp;
  const fs::path out = tmp.path() / "home";
  fs::create_directories(out);
  WriteText(out / "notes.txt", "the user's");
  const OutputPlace place = PlaceOutput(out.string(), LatestPublication("global_step100"));
  EXPECT_EQ(place.folder, (out / "global_step100").string());
  EXPECT_EQ(place.root, out.string());
  EXPECT_TRUE(place.notes.empty());
}

TEST(PlaceOutput, ARootInWithOutNamedAsTheTagIsThatTagFolder) {
  TempDir tmp;
  const fs::path out = tmp.path() / "t" / "r1" / "global_step100";
  const OutputPlace place = PlaceOutput(out.string(), LatestPublication("global_step100"));
  EXPECT_EQ(place.folder, out.string());
  EXPECT_EQ(place.root, (tmp.path() / "t" / "r1").string());  // made by the run
  ASSERT_EQ(place.notes.size(), 1u);
  EXPECT_NE(place.notes[0].find("is named as the source's tag"), std::string::npos) << place.notes[0];
}

TEST(PlaceOutput, TheParentOfATagFolderIsARootOnlyWhenMadeForItOrAlreadyOne) {
  TempDir tmp;
  const fs::path parent = tmp.path() / "run2";
  const std::string out = (parent / "global_step100").string();
  EXPECT_EQ(PlaceOutput(out, LatestPublication()).root, parent.string());  // absent: the run makes it
  fs::create_directories(parent);
  EXPECT_EQ(PlaceOutput(out, LatestPublication()).root, "");  // an empty folder the user made
  fs::create_directories(parent / "global_step100.reshard-partial-999999999");
  EXPECT_EQ(PlaceOutput(out, LatestPublication()).root, parent.string());  // a killed run made it
  WriteText(parent / "notes.txt", "the user's");
  const OutputPlace place = PlaceOutput(out, LatestPublication());
  EXPECT_EQ(place.root, "");
  ASSERT_EQ(place.notes.size(), 1u);
  EXPECT_NE(place.notes[0].find("latest not written into " + parent.string()), std::string::npos) << place.notes[0];
  WriteText(parent / "latest", "global_step5000");
  EXPECT_EQ(PlaceOutput(out, LatestPublication()).root, parent.string());  // a checkpoint root
}

TEST(PlaceOutput, ABareNameNeverMakesTheCurrentFolderARoot) {
  TempDir tmp;
  InFolder here(tmp.path());
  const OutputPlace place = PlaceOutput("out", LatestPublication());
  EXPECT_EQ(place.folder, (fs::current_path() / "out").string());
  EXPECT_EQ(place.root, "");
  ASSERT_EQ(place.notes.size(), 1u);
  EXPECT_NE(place.notes[0].find("(the current folder)"), std::string::npos) << place.notes[0];
  WriteText(tmp.path() / "latest", "global_step5");  // the user works in a checkpoint root
  EXPECT_EQ(PlaceOutput("out", LatestPublication()).root, fs::current_path().string());
}

TEST(CheckPointers, APointerNamingAnotherCheckpointNeedsOverwrite) {
  TempDir tmp;
  const std::string root = tmp.path().string();
  const std::vector<std::pair<std::string, std::string>> pointers = {{"latest", "global_step100"}};
  EXPECT_TRUE(CheckPointers(root, pointers, false).ok());  // none there yet
  WriteText(tmp.path() / "latest", "global_step100\n");
  EXPECT_TRUE(CheckPointers(root, pointers, false).ok());  // names this output already
  WriteText(tmp.path() / "latest", "global_step5000");
  const Status status = CheckPointers(root, pointers, false);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("latest names 'global_step5000', not this output's 'global_step100'"),
            std::string::npos) << status.message();
  EXPECT_TRUE(CheckPointers(root, pointers, true).ok());
  fs::remove(tmp.path() / "latest");
  fs::create_directories(tmp.path() / "latest");
  EXPECT_FALSE(CheckPointers(root, pointers, true).ok());  // a folder is never replaced
}

TEST(PointerTexts, APointerWithoutTextNamesTheFolder) {
  Publication publication = LatestPublication();
  publication.pointers.push_back({"latest_checkpointed_iteration.txt", std::string("7")});
  const auto texts = PointerTexts(publication, "/a/b/global_step7");
  ASSERT_EQ(texts.size(), 2u);
  EXPECT_EQ(texts[0], (std::pair<std::string, std::string>{"latest", "global_step7"}));
  EXPECT_EQ(texts[1].second, "7");
}

}  // namespace
}  // namespace reshard
