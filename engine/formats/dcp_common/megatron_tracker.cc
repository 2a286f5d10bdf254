#include "formats/dcp_common/megatron_tracker.h"

#include <sys/stat.h>

#include <cctype>
#include <cstdio>

#include "container/regular_file.h"
#include "util/strings.h"

namespace reshard {

Result<std::string> MegatronTrackedFolder(const std::string& root) {
  const std::string path = root + "/latest_checkpointed_iteration.txt";
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return std::string();
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, 64));
  const size_t begin = text.find_first_not_of(" \t\r\n");
  const std::string word =
      begin == std::string::npos ? "" : text.substr(begin, text.find_last_not_of(" \t\r\n") + 1 - begin);
  if (word == "release") return word;
  int64_t iteration = -1;
  if (!word.empty() && std::isdigit(static_cast<unsigned char>(word[0])) && ParseInt(word, &iteration)) {
    char folder[32];
    std::snprintf(folder, sizeof(folder), "iter_%07lld", static_cast<long long>(iteration));
    return std::string(folder);
  }
  return Status::InvalidInput(path + " holds '" + word.substr(0, 40) + "', not an iteration number or 'release' "
                              "(Megatron-LM's tracker names the folder iter_NNNNNNN of the root to read)");
}

}  // namespace reshard
