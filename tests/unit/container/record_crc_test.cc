// RecordCrcs checks a record read in pieces, in any order, and counts one
// read only in part.
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
  explicit Checked(bool damaged) {
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
    ZipRecord record{10, 100, Crc32(0, bytes.data(), bytes.size())};
    if (damaged) bytes[42] ^= 1;
    crcs = std::make_shared<RecordCrcs>("f.pt", std::vector<std::pair<std::string, ZipRecord>>{{"a/data/0", record}});
  }
  void Read(uint64_t begin, uint64_t end) {
    crcs->Note(10 + begin, end - begin, Crc32(0, bytes.data() + begin, end - begin));
  }
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
  EXPECT_EQ(good.crcs->PartlyRead(), 0);
  EXPECT_NE(bad.crcs->Damage().find("f.pt: record a/data/0 does not have the CRC-32"), std::string::npos);
}

TEST(RecordCrcsTest, ARecordReadInPartIsCounted) {
  Checked c(true);
  c.Read(0, 50);
  EXPECT_EQ(c.crcs->Damage(), "");
  EXPECT_EQ(c.crcs->PartlyRead(), 1);
}

TEST(RecordCrcsTest, RecordsAddedLaterAreCheckedAndOnlyOnce) {
  Checked c(true);
  std::vector<uint8_t> later(50, 3);
  const ZipRecord record{200, 50, Crc32(0, later.data(), later.size())};
  c.crcs->Add({{"b/data/0", record}});
  c.crcs->Add({{"b/data/0", record}});  // the same archive read again
  c.crcs->Note(200, 50, Crc32(0, later.data(), later.size()));
  EXPECT_EQ(c.crcs->Damage(), "");
  EXPECT_EQ(c.crcs->PartlyRead(), 0);
  c.Read(0, 100);
  EXPECT_NE(c.crcs->Damage().find("f.pt: record a/data/0 does not have the CRC-32"), std::string::npos);
}

}  // namespace
}  // namespace reshard
