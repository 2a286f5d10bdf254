// libreshard_torch_check.so (see torch_check.h): the only code of reshard
// that links LibTorch. Built as a module of its own, not into the engine.
#include <caffe2/serialize/inline_container.h>

#include <cstdio>
#include <exception>
#include <string>

#include "container/torch_check.h"

extern "C" int reshard_torch_check(const char* path, char* error, size_t error_size) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    // Extracting each record (one at a time in memory) is what torch.load
    // does. LibTorch 1.13's reader does not compare records with their
    // CRC-32s (a flipped byte loads), which reshard's own check does.
    for (const std::string& name : reader.getAllRecords()) reader.getRecord(name);
    return 0;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string line = what.substr(0, what.find('\n'));  // LibTorch appends a backtrace
    std::snprintf(error, error_size, "%s", line.c_str());
    return 1;
  }
}
