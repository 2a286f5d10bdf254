#include "container/torch_check.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "util/loaded_file.h"

namespace reshard {
namespace {

constexpr char kModule[] = "libreshard_torch_check.so";

// Where the module may be, in the order tried.
std::vector<std::string> Candidates() {
  if (const char* given = std::getenv("RESHARD_TORCH_CHECK_MODULE")) return {given};
  std::vector<std::string> paths;
  // Beside the binary, or beside the Python module of a pip-installed package.
  const std::string loaded_from = LoadedFileFolder();
  if (!loaded_from.empty()) paths.push_back((std::filesystem::path(loaded_from) / kModule).string());
#ifdef RESHARD_TORCH_CHECK_BUILD_PATH
  paths.push_back(RESHARD_TORCH_CHECK_BUILD_PATH);
#endif
  return paths;
}

// The first candidate that exists, opened. It is never closed: LibTorch's
// static state is not made to be unloaded.
Result<decltype(&reshard_torch_check)> OpenModule() {
  std::string tried;
  for (const std::string& path : Candidates()) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      tried += (tried.empty() ? "" : ", ") + path;
      continue;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return Status::Unsupported(std::string(::dlerror()));
    void* check = ::dlsym(handle, "reshard_torch_check");
    if (check == nullptr) return Status::Unsupported(path + " has no function reshard_torch_check");
    return reinterpret_cast<decltype(&reshard_torch_check)>(check);
  }
  return Status::Unsupported(std::string(kModule) + " is not installed (looked for " + tried + ")");
}

}  // namespace

Result<const TorchCheck*> TorchCheck::Load() {
  static const Result<decltype(&reshard_torch_check)> opened = OpenModule();
  if (!opened.ok()) return opened.status();
  static const TorchCheck check(*opened);
  return &check;
}

Status TorchCheck::Check(const std::string& path) const {
  char error[1024] = "";
  if (check_(path.c_str(), error, sizeof(error)) == 0) return Status::Ok();
  return Status::InvalidInput(path + ": LibTorch's reader (PyTorchStreamReader) refuses it: " + error);
}

}  // namespace reshard
