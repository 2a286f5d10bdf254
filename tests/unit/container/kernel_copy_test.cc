// WriteProduced: the spans a producer notes are copied from their files by
// the kernel, everything else is written from the produced bytes.
#include "container/kernel_copy.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "container/regular_file.h"
#include "test_util.h"
#include "util/crc32.h"

namespace reshard {
namespace {

constexpr int64_t kLong = 64 << 10;  // long enough to be copied by the kernel

std::vector<uint8_t> Filled(int64_t n, uint8_t value) { return std::vector<uint8_t>(static_cast<size_t>(n), value); }

class KernelCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The source holds 'S' bytes; the produced bytes are 'D's, so the
    // output shows which of the two wrote each byte.
    const std::string source = (dir_.path() / "source").string();
    const std::vector<uint8_t> bytes = Filled(4 * kLong, 'S');
    const int fd = ::open(source.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
    source_ = ::open(source.c_str(), O_RDONLY);
    target_path_ = (dir_.path() / "target").string();
    target_ = ::open(target_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  void TearDown() override {
    ::close(source_);
    ::close(target_);
  }
  std::string Target() { return *ReadRegularFile(target_path_); }

  TempDir dir_;
  int source_ = -1, target_ = -1;
  std::string target_path_;
};

TEST_F(KernelCopyTest, LongSpansComeFromTheFileTheRestFromTheBytes) {
  const std::vector<uint8_t> data = Filled(3 * kLong, 'D');
  const FileSpans spans = {{100, source_, 0, kLong}, {2 * kLong, source_, kLong, 1000}};
  ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), 0, spans), 0);
  const std::string out = Target();
  ASSERT_EQ(out.size(), data.size());
  EXPECT_EQ(out.substr(0, 100), std::string(100, 'D'));
  EXPECT_EQ(out.substr(100, kLong), std::string(kLong, 'S'));
  // The short span is written from the produced bytes with its neighbours.
  EXPECT_EQ(out.substr(100 + kLong), std::string(2 * kLong - 100, 'D'));
}

TEST_F(KernelCopyTest, AtTheFilePositionItContinuesWhereWritesLeftOff) {
  ASSERT_EQ(::write(target_, "head", 4), 4);
  const std::vector<uint8_t> data = Filled(kLong + 10, 'D');
  ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), -1, {{10, source_, 0, kLong}}), 0);
  ASSERT_EQ(::write(target_, "tail", 4), 4);
  EXPECT_EQ(Target(), "head" + std::string(10, 'D') + std::string(kLong, 'S') + "tail");
}

TEST_F(KernelCopyTest, ASourceThatEndsEarlyLeavesTheRestToTheBytes) {
  const std::vector<uint8_t> data = Filled(2 * kLong, 'D');
  ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), 0, {{0, source_, 3 * kLong, 2 * kLong}}), 0);
  EXPECT_EQ(Target(), std::string(kLong, 'S') + std::string(kLong, 'D'));
}

TEST_F(KernelCopyTest, SpansAreTakenInAnyOrderButNotWhenTheyOverlap) {
  const std::vector<uint8_t> data = Filled(2 * kLong, 'D');
  ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), 0, {{kLong, source_, 0, kLong}, {0, source_, 0, 10}}),
            0);
  EXPECT_EQ(Target(), std::string(kLong, 'D') + std::string(kLong, 'S'));
  const FileSpans overlapping = {{0, source_, 0, kLong + 1}, {kLong, source_, 0, kLong}};
  ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), 0, overlapping), 0);
  EXPECT_EQ(Target(), std::string(2 * kLong, 'D'));
}

TEST_F(KernelCopyTest, WhereTheKernelRefusesTheBytesAreWritten) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);  // copy_file_range takes no pipe: EINVAL
  const std::vector<uint8_t> data = Filled(2 * kLong, 'D');
  for (int twice = 0; twice < 2; ++twice) {  // the second time it is not asked
    ASSERT_EQ(WriteProduced(target_, data.data(), data.size(), 0, {{0, pipe_fds[0], 0, 2 * kLong}}), 0);
    EXPECT_EQ(Target(), std::string(2 * kLong, 'D'));
  }
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

TEST_F(KernelCopyTest, AnUnwritableTargetIsAnError) {
  const int read_only = ::open(target_path_.c_str(), O_RDONLY);
  const std::vector<uint8_t> data = Filled(kLong, 'D');
  EXPECT_NE(WriteProduced(read_only, data.data(), data.size(), 0, {{0, source_, 0, kLong}}), 0);
  ::close(read_only);
}

std::vector<uint8_t> Counting(int64_t n) {
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + (i >> 8));
  return bytes;
}

uint32_t CrcOf(const std::vector<uint8_t>& data, int64_t at, int64_t n) {
  return Crc32(0, data.data() + at, static_cast<size_t>(n));
}

TEST(ProducedCrcTest, SpansWithTheirCrcGiveTheCrcOfTheBytes) {
  const std::vector<uint8_t> data = Counting(3 * kLong);
  const FileSpans spans = {{2 * kLong, 3, 0, kLong - 5, CrcOf(data, 2 * kLong, kLong - 5)},
                           {100, 3, 0, kLong, CrcOf(data, 100, kLong)},
                           {kLong + 100, 3, 0, 1000, CrcOf(data, kLong + 100, 1000)},
                           {kLong + 2000, 3, 0, kLong / 2}};  // no CRC: read
  EXPECT_EQ(ProducedCrc(0, data.data(), data.size(), spans), Crc32(0, data.data(), data.size()));
  EXPECT_EQ(ProducedCrc(0x1234, data.data(), data.size(), spans), Crc32(0x1234, data.data(), data.size()));
}

TEST(ProducedCrcTest, ALongSpansCrcIsTakenNotComputedAgain) {
  const std::vector<uint8_t> data = Counting(2 * kLong);
  const uint32_t whole = Crc32(0, data.data(), data.size());
  // A CRC that is not that of the span's bytes shows which was used.
  EXPECT_NE(ProducedCrc(0, data.data(), data.size(), {{kLong, 3, 0, kLong, 0xdeadbeef}}), whole);
  // A short span's bytes are CRC'd again (cheaper than joining its CRC) ...
  EXPECT_EQ(ProducedCrc(0, data.data(), data.size(), {{kLong, 3, 0, 100, 0xdeadbeef}}), whole);
  // ... and overlapping spans are not trusted at all.
  const FileSpans overlapping = {{0, 3, 0, kLong + 1, 0xdeadbeef}, {kLong, 3, 0, kLong, 0xdeadbeef}};
  EXPECT_EQ(ProducedCrc(0, data.data(), data.size(), overlapping), whole);
}

}  // namespace
}  // namespace reshard
