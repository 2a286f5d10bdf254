// libFuzzer target: an HF folder's config.json and weight index
// (model.safetensors.index.json) as ReadHfFolder reads them: the input up to
// its first NUL byte is the config, the rest the index. Shards the index
// names are refused as missing files unless it names one of the two.
// Seeds: configs and indexes as transformers writes them (corpus/hf_json).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "formats/hf_common/hf_folder.h"

namespace {

void Write(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/dev/shm/reshard-hf-json-fuzz-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  size_t split = 0;
  while (split < size && data[split] != 0) ++split;
  Write(dir + "/config.json", data, split);
  const size_t rest = split < size ? split + 1 : size;
  Write(dir + "/model.safetensors.index.json", data + rest, size - rest);
  (void)reshard::ReadHfFolder(dir);
  return 0;
}
