// ListFolder: a folder's entries without exceptions. std::filesystem's
// directory iterator throws from operator++ (a symlink loop, an entry that
// vanishes or cannot be read) even when it was made with an error_code, so
// range-for over it lets filesystem_error escape.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

// The entries of `dir` (not recursive), in the order the system lists them.
Result<std::vector<std::filesystem::directory_entry>> ListFolder(const std::string& dir);

}  // namespace reshard
