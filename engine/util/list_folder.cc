#include "util/list_folder.h"

namespace reshard {

Result<std::vector<std::filesystem::directory_entry>> ListFolder(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::directory_entry> entries;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  if (ec) return Status::IoError("cannot list " + dir + ": " + ec.message());
  return entries;
}

}  // namespace reshard
