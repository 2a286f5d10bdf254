// OpenRegularFile / ReadRegularFile refuse FIFOs and devices without
// blocking.
#include "container/regular_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>


namespace reshard {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/regular_file_test_" + std::to_string(::getpid()) + "_" + name;
}

TEST(RegularFileTest, AFifoIsRefusedWithoutBlocking) {
  const std::string path = TempPath("fifo");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  Result<std::string> text = ReadRegularFile(path);  // no writer: a blocking open would hang here
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(text.status().message().find(path + " is a FIFO (named pipe), not a regular file"), std::string::npos);
  ::unlink(path.c_str());
}

TEST(RegularFileTest, ADeviceIsRefused) {
  Result<OpenedFile> zero = OpenRegularFile("/dev/zero");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("/dev/zero is a character device"), std::string::npos);
}

TEST(RegularFileTest, AFileIsReadWholeAndALargerOneRefused) {
  const std::string path = TempPath("text");
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("hello", f);
  std::fclose(f);
  Result<std::string> text = ReadRegularFile(path);
  ASSERT_TRUE(text.ok()) << text.status().message();
  EXPECT_EQ(*text, "hello");
  EXPECT_FALSE(ReadRegularFile(path, 4).ok());
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace reshard
