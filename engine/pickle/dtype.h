// Element types of tensor storages, and the PyTorch storage class names that
// name them inside a pickle (`torch.BFloat16Storage`, ...).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace reshard {

enum class DType {
  kFloat64,
  kFloat32,
  kFloat16,
  kBFloat16,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
  kComplex64,
  kComplex128,
};

// Bytes per element.
int ElementSize(DType dtype);

// "float32", "bfloat16", ... (PyTorch's dtype names, without "torch.").
const char* DTypeName(DType dtype);

// "FloatStorage", "BFloat16Storage", ... (the class name inside module `torch`).
const char* StorageClassName(DType dtype);

// Inverse of StorageClassName; nullopt for a name PyTorch does not use.
std::optional<DType> DTypeFromStorageClass(const std::string& class_name);

// "F32", "BF16", ...: the dtype's name in a safetensors header; null for
// the complex types, which safetensors cannot hold.
const char* SafetensorsDTypeName(DType dtype);

// Inverse of SafetensorsDTypeName; nullopt for a name reshard does not know.
std::optional<DType> DTypeFromSafetensorsName(const std::string& name);

// True for the floating-point types whose values reshard can average.
bool IsFloatingPoint(DType dtype);

// Converts one element stored at `p` (little-endian) to double.
// REQUIRES: IsFloatingPoint(dtype)
double LoadAsDouble(DType dtype, const uint8_t* p);

// Stores `v` at `p` in `dtype`, rounding to nearest even.
// REQUIRES: IsFloatingPoint(dtype)
void StoreFromDouble(DType dtype, double v, uint8_t* p);

// Converts `n` elements from `src` (of dtype `from`) to `dst` (of dtype
// `to`): what LoadAsDouble and StoreFromDouble give element by element, with
// fp32 to bf16 at memory speed; the same dtype is copied bit for bit (a
// signalling NaN stays one).
// REQUIRES: IsFloatingPoint(from) and IsFloatingPoint(to)
void ConvertElements(DType from, const uint8_t* src, int64_t n, DType to, uint8_t* dst);

}  // namespace reshard
