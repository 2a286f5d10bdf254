// MemoryBudget sizes the streaming buffers from what the budget leaves, and
// TouchedPages gives mapped pages back.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "exec/memory_budget.h"
#include "container/mapped_file.h"
#include "test_util.h"

namespace reshard {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryBudgetTest, BuffersFitTheBudget) {
  const int64_t budget = ResidentBytes() + 300 * kMiB;
  Result<MemoryBudget> m = MemoryBudget::Plan(budget, 2);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_GE(m->buffer_bytes, kMiB);
  EXPECT_LE(m->Estimate(), budget);
  EXPECT_EQ(m->threads, 2);
}

TEST(MemoryBudgetTest, BuffersAreCappedUnderALargeBudget) {
  Result<MemoryBudget> m = MemoryBudget::Plan(int64_t{64} << 30, 2);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->buffer_bytes, kMiB);  // larger buffers fall out of the CPU caches
}

TEST(MemoryBudgetTest, AnAskedBufferSizeIsUsedWhenTheBudgetHoldsIt) {
  Result<MemoryBudget> m = MemoryBudget::Plan(int64_t{64} << 30, 2, 0, 16 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->buffer_bytes, 16 * kMiB);  // past the 1 MiB the budget alone would give

  m = MemoryBudget::Plan(ResidentBytes() + 300 * kMiB, 2, 0, 256 * kMiB);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("smaller --buffer-size"), std::string::npos);

  m = MemoryBudget::Plan(int64_t{64} << 30, 2, 0, 1000);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("multiple of 4 KiB"), std::string::npos);
}

TEST(MemoryBudgetTest, ABudgetBelowWhatIsHeldIsRefused) {
  Result<MemoryBudget> m = MemoryBudget::Plan(ResidentBytes() / 2, 2);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("--max-memory"), std::string::npos);
  EXPECT_NE(m.status().message().find("allow at least"), std::string::npos);
}

TEST(TouchedPagesTest, ReleasedPagesLeaveResidentMemory) {
  TempDir dir;
  const std::string path = (dir.path() / "data").string();
  const size_t size = 64 * kMiB;
  {
    std::vector<uint8_t> bytes(size, 1);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), size), static_cast<ssize_t>(size));
    ::close(fd);
  }
  Result<std::shared_ptr<const MappedFile>> file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok());
  const ByteView view{*file, (*file)->data(), size, /*mapped=*/true};
  const int64_t before = ResidentBytes();
  TouchedPages pages;
  uint64_t sum = 0;
  for (size_t i = 0; i < size; i += 4096) sum += view.data[i];
  pages.Note(view, view.data, size);
  EXPECT_EQ(sum, size / 4096);
  EXPECT_GT(ResidentBytes() - before, 48 * kMiB);
  pages.Release();
  // Far below the 64 MiB touched; not tight: the allocator's own pages (more
  // under AddressSanitizer) move resident memory by a few pages either way.
  EXPECT_LT(ResidentBytes() - before, 16 * kMiB);
}

}  // namespace
}  // namespace reshard
