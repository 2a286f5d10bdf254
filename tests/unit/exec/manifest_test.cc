// WholeFiles joins the digests of a file's pieces, and refuses pieces that
// do not tile the file.
#include "exec/manifest.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "util/crc32.h"

namespace reshard {
namespace {

TEST(WholeFilesTest, PiecesJoinInAnyOrder) {
  const uint8_t bytes[] = "abcdefghij";
  const std::multimap<std::string, FileDigest> pieces = {{"f", {4, Crc32(0, bytes + 6, 4), 6}},
                                                         {"f", {6, Crc32(0, bytes, 6), 0}},
                                                         {"g", {3, 7, 0}}};
  Result<std::map<std::string, FileDigest>> files = WholeFiles(pieces);
  ASSERT_TRUE(files.ok()) << files.status().message();
  EXPECT_EQ(files->at("f").bytes, 10);
  EXPECT_EQ(files->at("f").crc32, Crc32(0, bytes, 10));
  EXPECT_EQ(files->at("g").crc32, 7u);
}

TEST(WholeFilesTest, PiecesThatLeaveAGapOrOverlapAreAnError) {
  const std::multimap<std::string, FileDigest> gap = {{"f", {10, 1, 0}}, {"f", {5, 2, 12}}};
  const std::multimap<std::string, FileDigest> overlap = {{"f", {10, 1, 0}}, {"f", {5, 2, 8}}};
  EXPECT_FALSE(WholeFiles(gap).ok());
  EXPECT_FALSE(WholeFiles(overlap).ok());
  const std::multimap<std::string, FileDigest> late_start = {{"f", {10, 1, 2}}};
  EXPECT_FALSE(WholeFiles(late_start).ok());
}

std::string ManifestListing(const std::string& name) {
  return "{\"files\": [{\"name\": \"" + name + "\", \"bytes\": 3, \"crc32\": \"0000abcd\"}]}";
}

TEST(ParseManifestTest, NamesInsideTheFolderAreRead) {
  for (const std::string name : {"mp_rank_00_model_states.pt", "sub/dir/file.bin", "..hidden", "a..b"}) {
    Result<Manifest> m = ParseManifest(ManifestListing(name), "m.json");
    ASSERT_TRUE(m.ok()) << name << ": " << m.status().message();
    EXPECT_EQ(m->files.count(name), 1u);
  }
}

TEST(ParseManifestTest, NamesLeavingTheFolderAreRefused) {
  for (const std::string name : {"../x.pt", "/etc/hostname", "a/../../x", "./x", "a//b", "a/", "..", "a/.."}) {
    Result<Manifest> m = ParseManifest(ManifestListing(name), "m.json");
    ASSERT_FALSE(m.ok()) << name;
    EXPECT_NE(m.status().message().find("lists '" + name + "', which is not a file inside its folder"),
              std::string::npos) << m.status().message();
  }
}

}  // namespace
}  // namespace reshard
