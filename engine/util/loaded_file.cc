#include "util/loaded_file.h"

#include <dlfcn.h>
#include <link.h>

#include <filesystem>

namespace reshard {
namespace {

namespace fs = std::filesystem;

std::string FindLoadedFileFolder() {
  Dl_info info;
  link_map* map = nullptr;
  if (::dladdr1(reinterpret_cast<void*>(&LoadedFileFolder), &info, reinterpret_cast<void**>(&map),
                RTLD_DL_LINKMAP) == 0 ||
      map == nullptr) {
    return "";
  }
  std::error_code ec;
  // The executable's link map has no name (dladdr would give argv[0], which
  // may be a bare name found on PATH); the kernel knows its path.
  const fs::path file = map->l_name[0] != '\0' ? fs::path(map->l_name) : fs::read_symlink("/proc/self/exe", ec);
  if (ec || file.empty()) return "";
  const fs::path absolute = fs::absolute(file, ec);
  return ec ? "" : absolute.parent_path().string();
}

}  // namespace

// Found once: a shared object's name may be relative to the folder the
// process was in when it was loaded, which may change later.
std::string LoadedFileFolder() {
  static const std::string folder = FindLoadedFileFolder();
  return folder;
}

}  // namespace reshard
