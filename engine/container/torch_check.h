// TorchCheck: LibTorch's reader of torch.save files, loaded on demand as an
// independent second reader of the container (`lint --deep`).
//
// reshard reads the zip container with its own code (zip_directory.h), so
// LibTorch stays off the start-up path: it lives in the module
// libreshard_torch_check.so, built next to the reshard binary, which opens a
// file with PyTorchStreamReader (what torch.load reads with) and extracts
// every record, as torch.load would. It checks the container as LibTorch
// sees it (the archive folder, the `version` record, every record readable),
// not the records' CRC-32s, which LibTorch 1.13 does not compare. Loading it
// costs LibTorch's start-up (about half a second), paid only by the commands
// that ask for the cross-check.
#pragma once

#include <cstddef>
#include <string>

#include "reshard/status.h"

// The module's one entry point. Reads every record of the torch.save file
// `path`; returns 0, or nonzero with a one-line reason in `error` (NUL
// terminated, cut to `error_size` bytes).
extern "C" int reshard_torch_check(const char* path, char* error, size_t error_size);

namespace reshard {

class TorchCheck {
 public:
  // The module, loaded once per process: from $RESHARD_TORCH_CHECK_MODULE
  // when that is set, else from the folder of the running executable, else
  // from where the build put it. The error says why it cannot be loaded.
  static Result<const TorchCheck*> Load();

  // InvalidInput naming `path` when LibTorch's reader refuses the file.
  Status Check(const std::string& path) const;

 private:
  using Function = int(const char*, char*, size_t);
  explicit TorchCheck(Function* check) : check_(check) {}
  Function* check_;
};

}  // namespace reshard
