#include "pickle/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace reshard {
namespace {

constexpr DType kAll[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16,   DType::kBFloat16,
                          DType::kInt64,   DType::kInt32,   DType::kInt16,     DType::kInt8,
                          DType::kUInt8,   DType::kBool,    DType::kComplex64, DType::kComplex128};

uint16_t Store16(DType dtype, double v) {
  uint8_t p[2];
  StoreFromDouble(dtype, v, p);
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

double Load16(DType dtype, uint16_t bits) {
  const uint8_t p[2] = {static_cast<uint8_t>(bits), static_cast<uint8_t>(bits >> 8)};
  return LoadAsDouble(dtype, p);
}

TEST(DTypeTest, SizesNamesAndStorageClasses) {
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2);
  EXPECT_EQ(ElementSize(DType::kFloat32), 4);
  EXPECT_EQ(ElementSize(DType::kInt64), 8);
  EXPECT_EQ(ElementSize(DType::kBool), 1);
  EXPECT_EQ(ElementSize(DType::kComplex128), 16);
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(DTypeName(DType::kUInt8), "uint8");
  EXPECT_STREQ(StorageClassName(DType::kFloat16), "HalfStorage");
  EXPECT_STREQ(StorageClassName(DType::kInt8), "CharStorage");
  EXPECT_STREQ(StorageClassName(DType::kComplex64), "ComplexFloatStorage");
  for (DType d : kAll) EXPECT_EQ(DTypeFromStorageClass(StorageClassName(d)), d) << DTypeName(d);
  EXPECT_EQ(DTypeFromStorageClass("QInt8Storage"), std::nullopt);
  EXPECT_EQ(DTypeFromStorageClass("UntypedStorage"), std::nullopt);
}

TEST(DTypeTest, FloatingPointTypes) {
  std::vector<DType> floating;
  for (DType d : kAll) {
    if (IsFloatingPoint(d)) floating.push_back(d);
  }
  EXPECT_EQ(floating, (std::vector<DType>{DType::kFloat64, DType::kFloat32, DType::kFloat16,
                                          DType::kBFloat16}));
}

TEST(DTypeTest, WideFloatsAreLittleEndian) {
  uint8_t p[8];
  StoreFromDouble(DType::kFloat32, 1.0, p);
  EXPECT_EQ(std::vector<uint8_t>(p, p + 4), (std::vector<uint8_t>{0x00, 0x00, 0x80, 0x3f}));
  EXPECT_EQ(LoadAsDouble(DType::kFloat32, p), 1.0);
  StoreFromDouble(DType::kFloat64, -2.5, p);
  EXPECT_EQ(std::vector<uint8_t>(p, p + 8), (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 0x04, 0xc0}));
  EXPECT_EQ(LoadAsDouble(DType::kFloat64, p), -2.5);
  StoreFromDouble(DType::kFloat32, 1.0 + std::ldexp(1.0, -24), p);  // a tie: rounds to even
  EXPECT_EQ(LoadAsDouble(DType::kFloat32, p), 1.0);
}

TEST(DTypeTest, BFloat16KnownValues) {
  EXPECT_EQ(Store16(DType::kBFloat16, 1.0), 0x3f80);
  EXPECT_EQ(Store16(DType::kBFloat16, -2.0), 0xc000);
  EXPECT_EQ(Store16(DType::kBFloat16, 3.140625), 0x4049);
  EXPECT_EQ(Store16(DType::kBFloat16, 0.0), 0x0000);
  EXPECT_EQ(Store16(DType::kBFloat16, -0.0), 0x8000);
  // Ties go to the even neighbour: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(Store16(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8)), 0x3f80);
  EXPECT_EQ(Store16(DType::kBFloat16, 1.0 + 3 * std::ldexp(1.0, -8)), 0x3f82);
  // Just above a tie rounds up, even when float32 would first round it down to the tie.
  EXPECT_EQ(Store16(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3f81);
  EXPECT_EQ(Store16(DType::kBFloat16, std::numeric_limits<double>::infinity()), 0x7f80);
  EXPECT_EQ(Store16(DType::kBFloat16, 1e300), 0x7f80);  // overflow
  EXPECT_EQ(Store16(DType::kBFloat16, -1e300), 0xff80);
  EXPECT_EQ(Store16(DType::kBFloat16, 1e-300), 0x0000);                 // underflow
  EXPECT_EQ(Store16(DType::kBFloat16, std::ldexp(1.0, -133)), 0x0001);  // smallest subnormal
  EXPECT_TRUE(std::isnan(Load16(DType::kBFloat16, Store16(DType::kBFloat16, std::nan("")))));
  EXPECT_EQ(Load16(DType::kBFloat16, 0x4049), 3.140625);
  EXPECT_EQ(Load16(DType::kBFloat16, 0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(Load16(DType::kBFloat16, 0xff80), -std::numeric_limits<double>::infinity());
}

TEST(DTypeTest, Float16KnownValues) {
  EXPECT_EQ(Store16(DType::kFloat16, 1.0), 0x3c00);
  EXPECT_EQ(Store16(DType::kFloat16, -2.0), 0xc000);
  EXPECT_EQ(Store16(DType::kFloat16, 65504.0), 0x7bff);  // largest finite
  EXPECT_EQ(Store16(DType::kFloat16, 65519.0), 0x7bff);  // below the halfway point to 65536
  EXPECT_EQ(Store16(DType::kFloat16, 65520.0), 0x7c00);  // the tie rounds to even: infinity
  EXPECT_EQ(Store16(DType::kFloat16, std::ldexp(1.0, -14)), 0x0400);      // smallest normal
  EXPECT_EQ(Store16(DType::kFloat16, std::ldexp(1.0, -24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(Store16(DType::kFloat16, std::ldexp(1.0, -25)), 0x0000);      // tie with zero: even
  EXPECT_EQ(Store16(DType::kFloat16, 3 * std::ldexp(1.0, -25)), 0x0002);  // tie: to even
  EXPECT_EQ(Store16(DType::kFloat16, std::ldexp(1023.5, -24)),
            0x0400);  // rounds up into the normals
  EXPECT_EQ(Store16(DType::kFloat16, -0.0), 0x8000);
  EXPECT_TRUE(std::isnan(Load16(DType::kFloat16, Store16(DType::kFloat16, std::nan("")))));
  EXPECT_EQ(Load16(DType::kFloat16, 0x7bff), 65504.0);
  EXPECT_EQ(Load16(DType::kFloat16, 0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(Load16(DType::kFloat16, 0x3555), 0.333251953125);
}

TEST(DTypeTest, SixteenBitFormatsRoundTripEveryValue) {
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    for (uint32_t bits = 0; bits < 0x10000; ++bits) {
      const double v = Load16(d, static_cast<uint16_t>(bits));
      if (std::isnan(v)) continue;
      ASSERT_EQ(Store16(d, v), bits) << DTypeName(d) << " " << v;
    }
  }
}

// Against an independent oracle: the nearest of all finite values, ties to
// the even bit pattern, with 2^(emax+1) standing for infinity (where IEEE
// rounding overflows).
TEST(DTypeTest, RandomValuesRoundToNearestEven) {
  std::mt19937_64 rng(7);
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<std::pair<double, uint16_t>> table;
    for (uint32_t bits = 0; bits < 0x8000; ++bits) {
      const double v = Load16(d, static_cast<uint16_t>(bits));
      if (std::isfinite(v)) table.emplace_back(v, static_cast<uint16_t>(bits));
    }
    const uint16_t inf = Store16(d, INFINITY);
    table.emplace_back(2 * std::ldexp(1.0, std::ilogb(table.back().first)), inf);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    const double max_exp = std::ilogb(table.back().first) + 1;
    for (int i = 0; i < 200000; ++i) {
      const double v = std::ldexp(unit(rng), static_cast<int>(-140 + unit(rng) * (max_exp + 140)));
      auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(v, uint16_t{0}));
      uint16_t expected = inf;
      if (hi != table.end() && hi->first == v) {
        expected = hi->second;
      } else if (hi != table.end()) {
        auto lo = hi - 1;
        const double dl = v - lo->first, dh = hi->first - v;
        expected = dl < dh   ? lo->second
                   : dh < dl ? hi->second
                             : (lo->second % 2 == 0 ? lo->second : hi->second);
      }
      ASSERT_EQ(Store16(d, v), expected) << DTypeName(d) << " " << v;
      ASSERT_EQ(Store16(d, -v), static_cast<uint16_t>(expected | 0x8000))
          << DTypeName(d) << " " << -v;
    }
  }
}

// bfloat16 is the top half of a float32: for values that are float32 already,
// rounding must match the usual bit trick.
TEST(DTypeTest, BFloat16MatchesFloat32BitTrick) {
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    ASSERT_EQ(Store16(DType::kBFloat16, f), rounded) << f;
  }
}

// ConvertElements gives what StoreFromDouble(LoadAsDouble) gives, element by
// element: on its fast fp32 -> bf16 path (NaNs, infinities, subnormals,
// ties and carries into the exponent included) and on the general one; the
// same dtype keeps every bit.
TEST(DTypeTest, ConvertElementsMatchesElementByElement) {
  std::mt19937 rng(5);
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u,
                                0x7F800001u, 0x00000001u, 0x007FFFFFu, 0x3F808000u, 0x3F818000u, 0x7F7FFFFFu,
                                0x3FFF8000u, 0x477FE000u};
  for (int i = 0; i < 200000; ++i) bits.push_back(rng());
  std::vector<uint8_t> src(bits.size() * 4);
  for (size_t i = 0; i < bits.size(); ++i) std::memcpy(&src[4 * i], &bits[i], 4);
  for (DType to : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    const int es = ElementSize(to);
    std::vector<uint8_t> fast(bits.size() * es), slow(bits.size() * es);
    ConvertElements(DType::kFloat32, src.data(), static_cast<int64_t>(bits.size()), to, fast.data());
    for (size_t i = 0; i < bits.size(); ++i) {
      StoreFromDouble(to, LoadAsDouble(DType::kFloat32, &src[4 * i]), &slow[i * es]);
    }
    if (to == DType::kFloat32) slow = src;  // the same dtype: the bits as they are
    for (size_t i = 0; i < bits.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(&fast[i * es], &slow[i * es], es)) << DTypeName(to) << " of bits " << std::hex << bits[i];
    }
  }
}

}  // namespace
}  // namespace reshard
