#include "pickle/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace reshard {
namespace {

struct DTypeInfo {
  DType dtype;
  int size;
  const char* name;
  const char* storage_class;
  const char* safetensors;  // null: safetensors has no name for it
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat64, 8, "float64", "DoubleStorage", "F64"},
    {DType::kFloat32, 4, "float32", "FloatStorage", "F32"},
    {DType::kFloat16, 2, "float16", "HalfStorage", "F16"},
    {DType::kBFloat16, 2, "bfloat16", "BFloat16Storage", "BF16"},
    {DType::kInt64, 8, "int64", "LongStorage", "I64"},
    {DType::kInt32, 4, "int32", "IntStorage", "I32"},
    {DType::kInt16, 2, "int16", "ShortStorage", "I16"},
    {DType::kInt8, 1, "int8", "CharStorage", "I8"},
    {DType::kUInt8, 1, "uint8", "ByteStorage", "U8"},
    {DType::kBool, 1, "bool", "BoolStorage", "BOOL"},
    {DType::kComplex64, 8, "complex64", "ComplexFloatStorage", nullptr},
    {DType::kComplex128, 16, "complex128", "ComplexDoubleStorage", nullptr},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is listed above
}

uint64_t LoadLE(const uint8_t* p, int n) {
  uint64_t bits = 0;
  for (int i = n - 1; i >= 0; --i) bits = (bits << 8) | p[i];
  return bits;
}

void StoreLE(uint64_t bits, int n, uint8_t* p) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(bits >> (8 * i));
}

// IEEE-754 binary format with `exp_bits` exponent and `man_bits` stored
// mantissa bits, at most 16 bits wide (float16: 5/10, bfloat16: 8/7).
struct SmallFloat {
  int exp_bits;
  int man_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  uint32_t max_exp_field() const { return (1u << exp_bits) - 1; }
  uint32_t sign_bit() const { return 1u << (exp_bits + man_bits); }
};

constexpr SmallFloat kHalf{5, 10};
constexpr SmallFloat kBF16{8, 7};

double DecodeSmall(SmallFloat f, uint32_t bits) {
  const uint32_t man = bits & ((1u << f.man_bits) - 1);
  const uint32_t exp = (bits >> f.man_bits) & f.max_exp_field();
  double magnitude;
  if (exp == f.max_exp_field()) {
    magnitude = man == 0 ? INFINITY : NAN;
  } else if (exp == 0) {  // subnormal: no implicit leading one
    magnitude = std::ldexp(static_cast<double>(man), 1 - f.bias() - f.man_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(man | (1u << f.man_bits)),
                           static_cast<int>(exp) - f.bias() - f.man_bits);
  }
  return (bits & f.sign_bit()) ? -magnitude : magnitude;
}

// Rounds straight from double (no detour through float, which would round
// twice) to nearest, ties to even.
uint32_t EncodeSmall(SmallFloat f, double v) {
  const uint32_t sign = std::signbit(v) ? f.sign_bit() : 0;
  const uint32_t inf = f.max_exp_field() << f.man_bits;
  if (std::isnan(v)) return sign | inf | (1u << (f.man_bits - 1));  // quiet NaN
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | inf;
  if (a == 0) return sign;
  // The spacing of representable values around `a`: fixed in the subnormal
  // range, 2^(e - man_bits) for a normal with exponent e.
  const int min_exp = 1 - f.bias();
  const int e = std::max(std::ilogb(a), min_exp);
  const double quantum = std::ldexp(1.0, e - f.man_bits);
  const double q = a / quantum;  // exact: scaling by a power of two
  double r = std::floor(q);
  const double frac = q - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0)) r += 1;
  // In the lowest binade and below it (subnormals) the spacing is the same
  // and the encoding is `r` itself. Above it, the biased exponent goes on top;
  // adding (rather than or-ing) lets a rounding carry (r == 2^(man_bits+1))
  // move into the next binade, and overflow reach infinity.
  uint64_t bits = static_cast<uint64_t>(r);
  if (e > min_exp) bits += static_cast<uint64_t>(e + f.bias() - 1) << f.man_bits;
  if (bits >= inf) return sign | inf;
  return sign | static_cast<uint32_t>(bits);
}

}  // namespace

int ElementSize(DType dtype) { return Info(dtype).size; }

const char* DTypeName(DType dtype) { return Info(dtype).name; }

const char* StorageClassName(DType dtype) { return Info(dtype).storage_class; }

std::optional<DType> DTypeFromStorageClass(const std::string& class_name) {
  for (const DTypeInfo& info : kDTypes) {
    if (class_name == info.storage_class) return info.dtype;
  }
  return std::nullopt;
}

const char* SafetensorsDTypeName(DType dtype) { return Info(dtype).safetensors; }

std::optional<DType> DTypeFromSafetensorsName(const std::string& name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.safetensors != nullptr && name == info.safetensors) return info.dtype;
  }
  return std::nullopt;
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kFloat64 || dtype == DType::kFloat32 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

double LoadAsDouble(DType dtype, const uint8_t* p) {
  switch (dtype) {
    case DType::kFloat64: {
      const uint64_t bits = LoadLE(p, 8);
      double d;
      std::memcpy(&d, &bits, 8);
      return d;
    }
    case DType::kFloat32: {
      const uint32_t bits = static_cast<uint32_t>(LoadLE(p, 4));
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kFloat16: return DecodeSmall(kHalf, static_cast<uint32_t>(LoadLE(p, 2)));
    case DType::kBFloat16: return DecodeSmall(kBF16, static_cast<uint32_t>(LoadLE(p, 2)));
    default: return 0;  // not floating point: excluded by the contract
  }
}

void StoreFromDouble(DType dtype, double v, uint8_t* p) {
  switch (dtype) {
    case DType::kFloat64: {
      uint64_t bits;
      std::memcpy(&bits, &v, 8);
      StoreLE(bits, 8, p);
      return;
    }
    case DType::kFloat32: {
      const float f = static_cast<float>(v);  // the default rounding mode is to nearest even
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      StoreLE(bits, 4, p);
      return;
    }
    case DType::kFloat16: StoreLE(EncodeSmall(kHalf, v), 2, p); return;
    case DType::kBFloat16: StoreLE(EncodeSmall(kBF16, v), 2, p); return;
    default: return;  // not floating point: excluded by the contract
  }
}

namespace {

// fp32 bits to bf16 bits, rounded to nearest even; a NaN becomes the quiet
// NaN of its sign, as EncodeSmall makes it.
uint16_t Bf16OfFloatBits(uint32_t x) {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace

void ConvertElements(DType from, const uint8_t* src, int64_t n, DType to, uint8_t* dst) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * ElementSize(from));
    return;
  }
  if (from == DType::kFloat32 && to == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) StoreLE(Bf16OfFloatBits(static_cast<uint32_t>(LoadLE(src + 4 * i, 4))), 2, dst + 2 * i);
    return;
  }
  const int se = ElementSize(from), de = ElementSize(to);
  for (int64_t i = 0; i < n; ++i) StoreFromDouble(to, LoadAsDouble(from, src + i * se), dst + i * de);
}

}  // namespace reshard
