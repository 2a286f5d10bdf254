// ByteProducer's spans: traced producers note them, in the positions of the
// whole range; plain ones note none.
#include "util/byte_producer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "util/crc32.h"

namespace reshard {
namespace {

// A traced producer that "copies" its bytes from file 7 at byte 1000 + offset.
ByteProducer FromFile7() {
  return ByteProducer::Traced([](int64_t offset, int64_t length, uint8_t* dst, const SpanSink& spans) {
    std::memset(dst, 'x', static_cast<size_t>(length));
    spans.Note(dst, 7, 1000 + offset, length);
    return Status::Ok();
  });
}

TEST(ByteProducerTest, APlainProducerNotesNoSpans) {
  const ByteProducer plain = [](int64_t, int64_t length, uint8_t* dst) {
    std::memset(dst, 'p', static_cast<size_t>(length));
    return Status::Ok();
  };
  std::vector<uint8_t> buffer(8);
  FileSpans spans;
  ASSERT_TRUE(plain(0, 8, buffer.data(), SpanSink(&spans, buffer.data(), 8)).ok());
  EXPECT_EQ(buffer[7], 'p');
  EXPECT_TRUE(spans.empty());
}

TEST(ByteProducerTest, ContinuingNotesMergeAndNotesOutsideTheRangeAreDropped) {
  std::vector<uint8_t> buffer(100), scratch(10);
  FileSpans spans;
  const SpanSink sink(&spans, buffer.data(), 100);
  sink.Note(buffer.data(), 3, 50, 10);
  sink.Note(buffer.data() + 10, 3, 60, 20);  // continues the first in both
  sink.Note(buffer.data() + 30, 3, 90, 5);   // not in the file
  sink.Note(buffer.data() + 35, 4, 95, 5);   // another file
  sink.Note(scratch.data(), 3, 0, 10);       // not in the range
  sink.Note(buffer.data() + 95, 3, 0, 10);   // runs past it
  sink.Note(buffer.data() + 40, -1, 0, 10);  // no descriptor
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].at, 0);
  EXPECT_EQ(spans[0].offset, 50);
  EXPECT_EQ(spans[0].length, 30);
  EXPECT_EQ(spans[1].at, 30);
  EXPECT_EQ(spans[2].fd, 4);
}

TEST(ByteProducerTest, MergedNotesJoinTheirCrcsWhereBothHaveOne) {
  std::vector<uint8_t> buffer(100);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<uint8_t>(i * 3);
  const auto crc = [&](int64_t at, int64_t n) { return Crc32(0, buffer.data() + at, static_cast<size_t>(n)); };
  FileSpans spans;
  const SpanSink sink(&spans, buffer.data(), 100);
  sink.Note(buffer.data(), 3, 0, 10, crc(0, 10));
  sink.Note(buffer.data() + 10, 3, 10, 30, crc(10, 30));
  sink.Note(buffer.data() + 50, 3, 60, 10, crc(50, 10));
  sink.Note(buffer.data() + 60, 3, 70, 10);  // no CRC: the merged span has none
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].crc, crc(0, 40));
  EXPECT_EQ(spans[1].length, 20);
  EXPECT_FALSE(spans[1].crc.has_value());
}

TEST(ByteProducerTest, JoinedBytesPlacesPiecesWithZerosBetweenAndForwardsSpans) {
  const ByteProducer joined = JoinedBytes({{6, 4, FromFile7()}, {0, 4, FromFile7()}});
  std::vector<uint8_t> buffer(12, 0xff);
  FileSpans spans;
  // Bytes [2, 12): the first piece's last two, a gap, the second piece, a tail.
  ASSERT_TRUE(joined(2, 10, buffer.data() + 2, SpanSink(&spans, buffer.data(), 12)).ok());
  EXPECT_EQ(std::string(buffer.begin() + 2, buffer.end()), std::string("xx\0\0xxxx\0\0", 10));
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].at, 2);
  EXPECT_EQ(spans[0].offset, 1002);
  EXPECT_EQ(spans[0].length, 2);
  EXPECT_EQ(spans[1].at, 6);
  EXPECT_EQ(spans[1].offset, 1000);
  EXPECT_EQ(spans[1].length, 4);
}

TEST(ByteProducerTest, BytesFromForwardsSpans) {
  std::vector<uint8_t> buffer(4);
  FileSpans spans;
  ASSERT_TRUE(BytesFrom(FromFile7(), 8)(0, 4, buffer.data(), SpanSink(&spans, buffer.data(), 4)).ok());
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].offset, 1008);
}

}  // namespace
}  // namespace reshard
