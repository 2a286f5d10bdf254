// RecordCrcs checks a record read in pieces, in any order, also by several
// processes, and counts one read only in part.
#include "container/record_crc.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "util/crc32.h"

namespace reshard {
namespace {

// A record of 100 bytes at offset 10 of a file, read back in pieces.
struct Checked {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(100);
  std::shared_ptr<RecordCrcs> crcs;
  explicit Checked(bool damaged, const std::string& path = "f.pt") {
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
    ZipRecord record{10, 100, Crc32(0, bytes.data(), bytes.size())};
    if (damaged) bytes[42] ^= 1;
    crcs = std::make_shared<RecordCrcs>(path, std::vector<std::pair<std::string, ZipRecord>>{{"a/data/0", record}});
  }
  uint32_t CrcOf(uint64_t begin, uint64_t end) const { return Crc32(0, bytes.data() + begin, end - begin); }
  void Read(uint64_t begin, uint64_t end) { crcs->Note(10 + begin, end - begin, CrcOf(begin, end)); }
};

TEST(RecordCrcsTest, PiecesInAnyOrderCheckTheRecord) {
  Checked good(false), bad(true);
  for (Checked* c : {&good, &bad}) {
    c->Read(60, 100);
    c->Read(0, 30);
    c->Read(20, 50);  // overlaps: not counted
    c->Read(30, 60);
  }
  EXPECT_EQ(good.crcs->Damage(), "");
  EXPECT_EQ(good.crcs->PartlyRead().size(), 0u);
  EXPECT_NE(bad.crcs->Damage().find("f.pt: record a/data/0 does not have the CRC-32"), std::string::npos);
}

TEST(RecordCrcsTest, ARecordReadInPartIsCounted) {
  Checked c(true);
  c.Read(0, 50);
  EXPECT_EQ(c.crcs->Damage(), "");
  EXPECT_EQ(c.crcs->PartlyRead().size(), 1u);
}

TEST(RecordCrcsTest, RecordsAddedLaterAreCheckedAndOnlyOnce) {
  Checked c(true);
  std::vector<uint8_t> later(50, 3);
  const ZipRecord record{200, 50, Crc32(0, later.data(), later.size())};
  c.crcs->Add({{"b/data/0", record}});
  c.crcs->Add({{"b/data/0", record}});  // the same archive read again
  c.crcs->Note(200, 50, Crc32(0, later.data(), later.size()));
  EXPECT_EQ(c.crcs->Damage(), "");
  EXPECT_EQ(c.crcs->PartlyRead().size(), 0u);
  c.Read(0, 100);
  EXPECT_NE(c.crcs->Damage().find("f.pt: record a/data/0 does not have the CRC-32"), std::string::npos);
}

// Two processes each read half of a record: joined through the text one sends
// the other, the record is checked whole.
TEST(RecordCrcsTest, PiecesOfAnotherProcessAreJoined) {
  Checked mine(true, "joined.pt"), theirs(true, "joined.pt");
  RegisterRecordCrcs(mine.crcs);
  mine.Read(0, 50);
  const std::string text = "9 joined.pt 1\n10 50 100 " + std::to_string(theirs.CrcOf(50, 100)) + "\n";
  EXPECT_TRUE(JoinPartlyReadPieces(text).ok());
  EXPECT_TRUE(mine.crcs->PartlyRead().empty());
  EXPECT_NE(mine.crcs->Damage().find("joined.pt: record a/data/0 does not have the CRC-32"), std::string::npos);
  EXPECT_FALSE(CheckReadRecords().ok());
}

TEST(RecordCrcsTest, PiecesReadInPartAreSentAsText) {
  Checked c(false, "sent.pt");
  RegisterRecordCrcs(c.crcs);
  c.Read(0, 30);
  EXPECT_NE(PartlyReadPieces().find("7 sent.pt 1\n10 0 30 " + std::to_string(c.CrcOf(0, 30)) + "\n"),
            std::string::npos);
  EXPECT_EQ(PartlyReadRecords(), std::vector<std::string>{"10 sent.pt"});
  EXPECT_EQ(PartlyReadRecordsNote(1).rfind("1 zip record(s) were read only in part", 0), 0u);
  EXPECT_EQ(JoinPartlyReadPieces("3 sen").code(), Status::Code::kInvalidInput);
  EXPECT_EQ(JoinPartlyReadPieces("7 sent.pt 1\n10 x").code(), Status::Code::kInvalidInput);
}

}  // namespace
}  // namespace reshard
