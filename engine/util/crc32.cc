#include "util/crc32.h"

#include <zlib.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace reshard {
namespace {

uint32_t ZlibCrc32(uint32_t crc, const uint8_t* data, size_t n) {
  return static_cast<uint32_t>(::crc32_z(crc, data, n));
}

#if defined(__x86_64__)

// Carry-less multiplication folding (Intel, "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ Instruction", 2009), for the
// bit-reflected IEEE polynomial 0x104C11DB7. A 128-bit lane is folded D bits
// forward by multiplying its two halves by x^(D+32) and x^(D-32) mod P (as
// FoldKeys gives them) and adding the data D bits on. Folding keeps the
// register congruent, modulo P, to the message so far, so the last 128-bit
// lane is the message's remainder: its CRC as 16 bytes of data from a zero
// register, which zlib computes, continued over the tail.

// x^e mod P, bit-reflected and shifted left by one (the product of two
// reflected operands comes out one bit short): the paper's constants.
constexpr uint64_t ReflectedPowerModP(int e) {
  constexpr uint64_t kP = 0x104C11DB7;
  uint64_t r = 1;
  for (int i = 0; i < e; ++i) {
    r <<= 1;
    if (r >> 32) r ^= kP;
  }
  uint64_t reflected = 0;
  for (int bit = 0; bit < 32; ++bit) reflected |= ((r >> bit) & 1) << (31 - bit);
  return reflected << 1;
}

// The multipliers that fold a lane D bits forward: the low half's, the high half's.
struct FoldKeys {
  uint64_t lo, hi;
};
constexpr FoldKeys KeysFor(int distance_bits) {
  return {ReflectedPowerModP(distance_bits + 32), ReflectedPowerModP(distance_bits - 32)};
}
constexpr FoldKeys kFold128 = KeysFor(128);    // the next lane
constexpr FoldKeys kFold512 = KeysFor(512);    // four lanes on (64 bytes)
constexpr FoldKeys kFold2048 = KeysFor(2048);  // sixteen lanes on (256 bytes)
static_assert(kFold512.lo == 0x154442bd4 && kFold512.hi == 0x1c6e41596, "the paper's constants for D = 512");

__attribute__((target("pclmul,sse4.1"))) inline __m128i Keys128(FoldKeys k) {
  return _mm_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo));
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i lane, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(lane, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(lane, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i Load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Folds the four lanes x[0..3] (the 64 bytes before `data`, folded so far)
// over the n bytes at data and returns the CRC.
__attribute__((target("pclmul,sse4.1"))) uint32_t FinishFolding(__m128i x0, __m128i x1, __m128i x2, __m128i x3,
                                                               const uint8_t* data, size_t n) {
  const __m128i k512 = Keys128(kFold512);
  for (; n >= 64; data += 64, n -= 64) {
    x0 = Fold(x0, k512, Load(data));
    x1 = Fold(x1, k512, Load(data + 16));
    x2 = Fold(x2, k512, Load(data + 32));
    x3 = Fold(x3, k512, Load(data + 48));
  }
  const __m128i k128 = Keys128(kFold128);
  __m128i x = Fold(Fold(Fold(x0, k128, x1), k128, x2), k128, x3);
  for (; n >= 16; data += 16, n -= 16) x = Fold(x, k128, Load(data));
  alignas(16) uint8_t remainder[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(remainder), x);
  // ZlibCrc32(~0u, ...) runs from a zero register (zlib inverts on the way in).
  return ZlibCrc32(ZlibCrc32(~0u, remainder, 16), data, n);
}

// REQUIRES: n >= 64. Four 128-bit lanes take 64 bytes per step.
__attribute__((target("pclmul,sse4.1"))) uint32_t FoldedCrc32(uint32_t crc, const uint8_t* data, size_t n) {
  // The register's initial value (zlib's running CRC, inverted) is added to
  // the first four bytes of the message.
  const __m128i x0 = _mm_xor_si128(Load(data), _mm_cvtsi32_si128(static_cast<int>(~crc)));
  return FinishFolding(x0, Load(data + 16), Load(data + 32), Load(data + 48), data + 64, n - 64);
}

#define RESHARD_WIDE_FOLD __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))

RESHARD_WIDE_FOLD inline __m512i Keys512(FoldKeys k) {
  const auto lo = static_cast<long long>(k.lo), hi = static_cast<long long>(k.hi);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}

// The same fold on four lanes at once (a 512-bit register).
RESHARD_WIDE_FOLD inline __m512i Fold4(__m512i lanes, __m512i k, __m512i next) {
  const __m512i lo = _mm512_clmulepi64_epi128(lanes, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(lanes, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

RESHARD_WIDE_FOLD inline __m512i Load4(const uint8_t* p) { return _mm512_loadu_si512(p); }

// REQUIRES: n >= 256. Sixteen lanes in four 512-bit registers take 256
// bytes per step, with four independent chains of multiplications in flight
// (the multiplier's latency, not its throughput, bounds a single chain);
// they are folded into four lanes, which FinishFolding takes on.
RESHARD_WIDE_FOLD uint32_t WideFoldedCrc32(uint32_t crc, const uint8_t* data, size_t n) {
  __m512i y0 = _mm512_xor_si512(Load4(data), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  __m512i y1 = Load4(data + 64), y2 = Load4(data + 128), y3 = Load4(data + 192);
  data += 256;
  n -= 256;
  const __m512i k2048 = Keys512(kFold2048);
  for (; n >= 256; data += 256, n -= 256) {
    y0 = Fold4(y0, k2048, Load4(data));
    y1 = Fold4(y1, k2048, Load4(data + 64));
    y2 = Fold4(y2, k2048, Load4(data + 128));
    y3 = Fold4(y3, k2048, Load4(data + 192));
  }
  const __m512i k512 = Keys512(kFold512);
  alignas(64) __m128i lanes[4];
  _mm512_store_si512(lanes, Fold4(Fold4(Fold4(y0, k512, y1), k512, y2), k512, y3));
  return FinishFolding(lanes[0], lanes[1], lanes[2], lanes[3], data, n);
}

bool HasPclmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

// __builtin_cpu_supports answers for AVX-512 only where the OS saves its registers.
bool HasWidePclmul() {
  static const bool has = HasPclmul() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  return has;
}

#endif

}  // namespace

// zlib's braided CRC runs at about 1.7 GB/s on the benchmark machine, which
// made it a seventh of a warm conversion's time. Folding 128-bit lanes with
// carry-less multiplication runs at 11 GB/s there, folding 512-bit
// registers (AVX-512 with VPCLMULQDQ) at 43-52 GB/s (crc_bench, 4 KiB and
// 1 MiB in cache): every byte written is CRC'd, so this is CPU per byte.
uint32_t Crc32(uint32_t crc, const uint8_t* data, size_t n) {
  if (n == 0) return crc;  // zlib would answer a null `data` with 0
#if defined(__x86_64__)
  if (n >= 256 && HasWidePclmul()) return WideFoldedCrc32(crc, data, n);
  if (n >= 64 && HasPclmul()) return FoldedCrc32(crc, data, n);
#endif
  return ZlibCrc32(crc, data, n);
}

uint32_t Crc32Combine(uint32_t first, uint32_t second, int64_t second_bytes) {
  return static_cast<uint32_t>(::crc32_combine(first, second, static_cast<z_off_t>(second_bytes)));
}

}  // namespace reshard
