// libFuzzer target: reshard-manifest.json as `verify OUT` reads it (every
// entry's name, size and CRC-32; names confined to the folder).
// Seeds: manifests reshard wrote (corpus/manifest).
#include <cstddef>
#include <cstdint>
#include <string>

#include "exec/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  reshard::Result<reshard::Manifest> m = reshard::ParseManifest(text, "reshard-manifest.json");
  if (!m.ok()) return 0;
  for (const auto& [name, digest] : m->files) {
    // What ParseManifest promises: no name leaves the folder.
    const std::string wrapped = "/" + name + "/";
    if (name.empty() || name.front() == '/' || wrapped.find("/../") != std::string::npos ||
        wrapped.find("/./") != std::string::npos || wrapped.find("//") != std::string::npos) {
      __builtin_trap();
    }
  }
  return 0;
}
