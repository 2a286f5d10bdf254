// Helpers for reshard's unit tests.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

// A fresh folder under the system temp dir, removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "reshard-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Writes a checkpoint with the Python fixture generator (real torch.save):
// `args` are its command-line options, e.g. "--style bs_bloom --tp 2".
inline Status MakeFixture(const std::string& args, const std::filesystem::path& root) {
  const std::string cmd = std::string("PYTHONPATH=") + RESHARD_SOURCE_DIR + "/tests " +
                          RESHARD_PYTHON + " -m fixtures.megatron_fixture " + args + " " +
                          root.string() + " > /dev/null";
  if (std::system(cmd.c_str()) != 0) return Status::Internal("fixture generator failed: " + cmd);
  return Status::Ok();
}

}  // namespace reshard
