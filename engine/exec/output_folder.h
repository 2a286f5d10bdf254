// OutputFolder: makes a converted checkpoint appear atomically.
//
// Files are written into a staging folder beside the destination
// (`OUT.reshard-partial-<pid>`), which is renamed to OUT only when everything
// succeeded; a failed or interrupted run leaves OUT untouched. `latest` is
// written after the rename, itself through a temporary file and a rename.
// Each step is flushed to the disk before the next (the files, by
// SyncFileSystem once all are written, then the staging folder, the renamed
// folder's parent, `latest` and its folder), so what a power loss leaves is
// the old state or the new.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "reshard/status.h"

namespace reshard {

class OutputFolder {
 public:
  // Checks that `out` may be written: it neither contains nor lies inside any
  // of `inputs`, and it is absent or empty unless `overwrite`. Creates nothing.
  static Result<OutputFolder> Check(const std::string& out, const std::vector<std::string>& inputs,
                                    bool overwrite);

  OutputFolder(OutputFolder&& other) noexcept;
  OutputFolder& operator=(OutputFolder&&) = delete;
  ~OutputFolder();  // removes the staging folder unless committed

  // Creates the staging folder (and OUT's parents).
  Status Begin();
  const std::string& staging_dir() const { return staging_; }
  // Moves the staging folder to OUT (replacing an old OUT when overwriting).
  Status Commit();

  const std::string& path() const { return out_; }

 private:
  explicit OutputFolder(std::string out);
  std::string out_;
  std::string staging_;
  bool committed_ = false;
};

// Flushes every file written into `dir` (a staging folder) to the disk. One
// flush of the file system after all writes lets the kernel write back in
// bulk; a flush per file would wait for the disk between files. Every
// process that wrote files calls it before the folder is committed.
Status SyncFiles(const std::string& dir);

// Copies the file `from` into folder `root` under its own name, atomically,
// unless `root` has a file of that name already (it is left alone).
// Returns whether it copied.
Result<bool> CopyIntoRoot(const std::string& from, const std::string& root);

// Writes `<root>/<file>` = tag and, when `iteration` is given,
// `<root>/latest_checkpointed_iteration.txt`, each atomically.
Status UpdateLatest(const std::string& root, const std::string& tag,
                    std::optional<int64_t> iteration, const std::string& file = "latest");

}  // namespace reshard
