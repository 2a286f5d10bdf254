// Crc32's folding paths (64 bytes and more on CPUs with carry-less
// multiplication, 256 and more on those that fold 512-bit registers) against
// zlib's table-driven CRC: the same value for every length and alignment
// (past several wide steps and every tail after them), and when continued
// from a previous CRC. The known
// values and a bitwise reference are in zip_writer_test.cc.
#include "util/crc32.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <random>
#include <vector>

namespace reshard {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(gen());
  return bytes;
}

uint32_t Zlib(uint32_t crc, const uint8_t* data, size_t n) {
  return static_cast<uint32_t>(::crc32_z(crc, data, n));
}

TEST(Crc32FoldingTest, EqualsZlibForEveryLengthAndAlignment) {
  const std::vector<uint8_t> bytes = RandomBytes(4096 + 64, 1);
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t n = 0; n <= 1100; ++n) {
      ASSERT_EQ(Crc32(0, bytes.data() + offset, n), Zlib(0, bytes.data() + offset, n)) << offset << " " << n;
      ASSERT_EQ(Crc32(0x5eed1234, bytes.data() + offset, n), Zlib(0x5eed1234, bytes.data() + offset, n))
          << offset << " " << n;
    }
  }
  for (size_t n : {1023u, 1024u, 4095u, 4096u}) EXPECT_EQ(Crc32(0, bytes.data() + 3, n), Zlib(0, bytes.data() + 3, n));
}

TEST(Crc32FoldingTest, ContinuesFromAPreviousCrc) {
  const std::vector<uint8_t> bytes = RandomBytes(1 << 20, 2);
  const uint32_t whole = Zlib(0, bytes.data(), bytes.size());
  for (size_t cut : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{1 << 19}}) {
    EXPECT_EQ(Crc32(Crc32(0, bytes.data(), cut), bytes.data() + cut, bytes.size() - cut), whole) << cut;
  }
  EXPECT_EQ(Crc32Combine(Crc32(0, bytes.data(), 777), Crc32(0, bytes.data() + 777, bytes.size() - 777),
                         static_cast<int64_t>(bytes.size() - 777)),
            whole);
}

}  // namespace
}  // namespace reshard
