// libFuzzer target: the zip container checks (central directory, local
// headers, record bounds) on arbitrary files. Seeds: small torch.save files
// (corpus/zip).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "container/mapped_file.h"
#include "container/zip_directory.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The reader works on mapped files: write the input to one.
  static const std::string path = "/dev/shm/reshard-zip-fuzz-" + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  reshard::Result<std::shared_ptr<const reshard::MappedFile>> file = reshard::MappedFile::Open(path);
  if (file.ok()) (void)reshard::ZipDirectory::Read(**file);
  return 0;
}
