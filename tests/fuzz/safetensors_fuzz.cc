// libFuzzer target: the safetensors reader (the 8-byte length, the JSON
// header, every tensor's dtype, shape and byte range) on arbitrary files.
// Seeds: small safetensors files (corpus/safetensors).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "container/safetensors_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The reader works on mapped files: write the input to one.
  static const std::string path = "/dev/shm/reshard-safetensors-fuzz-" + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  (void)reshard::ReadSafetensors(path);
  return 0;
}
