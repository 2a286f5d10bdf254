// libFuzzer target: the Distributed Checkpoint `.metadata` reader (the
// pickle with DCP's allow-list and inert foreign classes, then every item,
// chunk and storage entry checked) on arbitrary files.
// Seeds: real torch 2.6 and Megatron-Core `.metadata` files (corpus/dcp_metadata).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "container/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The reader takes a path, as it meets the file in a checkpoint folder.
  static const std::string path = "/dev/shm/reshard-dcp-metadata-fuzz-" + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  (void)reshard::ReadDcpMetadata(path);
  return 0;
}
