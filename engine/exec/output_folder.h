// OutputFolder: makes a converted checkpoint appear atomically.
//
// Files are written into a staging folder beside the destination
// (`OUT.reshard-partial-<pid>`), which is renamed to OUT only when everything
// succeeded; a failed or interrupted run leaves OUT untouched. The files a
// format writes beside OUT (the pointer its readers follow) are written after
// the rename, each through a temporary file and a rename. Each step is
// flushed to the disk before the next (the files, by SyncFileSystem once all
// are written, then the staging folder, the renamed folder's parent, each
// file beside it and its folder), so what a power loss leaves is the old
// state or the new.
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
  ~OutputFolder();  // removes the staging folder and the parents Begin made, unless committed

  // Takes the lock on OUT (a second run writing OUT is refused until this
  // one ends), re-checks that OUT is still empty, removes what killed runs
  // left beside OUT, and creates the staging folder (and OUT's parents).
  // When `fingerprint` is set and a killed run's staging folder holds the
  // journal of a run with that fingerprint, that folder becomes this run's
  // staging folder instead (RunJournal says what in it can be reused).
  Status Begin(const std::string& fingerprint = "");
  const std::string& staging_dir() const { return staging_; }
  // Moves the staging folder to OUT: a rename, or with an old OUT one atomic
  // exchange, after which the old folder is removed. Releases the lock.
  Status Commit();

  const std::string& path() const { return out_; }
  // The staging folders of killed runs that Begin removed (names in OUT's parent).
  const std::vector<std::string>& leftovers() const { return leftovers_; }
  // The killed run's staging folder Begin took over ("" when none).
  const std::string& resumed() const { return resumed_; }

 private:
  explicit OutputFolder(std::string out);
  std::string LockPath() const;  // `.<OUT name>.reshard-lock` beside OUT
  Status Lock();
  void Unlock();
  Status CheckStillEmpty() const;
  void RemoveLeftovers(const std::string& fingerprint);

  std::string out_;
  std::string staging_;
  bool overwrite_ = false;
  bool committed_ = false;
  int lock_fd_ = -1;
  std::vector<std::string> created_parents_;  // by Begin, deepest first
  std::vector<std::string> leftovers_;
  std::string resumed_;
};

// Removes the staging folders and lock files of every OutputFolder begun
// and not yet committed or destroyed in this process (for an interrupted run).
void RemoveStagingFolders();

// Flushes every file written into `dir` (a staging folder) to the disk. One
// flush of the file system after all writes lets the kernel write back in
// bulk; a flush per file would wait for the disk between files. Every
// process that wrote files calls it before the folder is committed.
Status SyncFiles(const std::string& dir);

// Copies the file `from` into folder `root` under its own name, atomically,
// unless `root` has a file of that name already (it is left alone).
// Returns whether it copied.
Result<bool> CopyIntoRoot(const std::string& from, const std::string& root);

// Refuses before anything is written when a file of `names` in `root` could
// not be replaced: a folder stands there.
Status CheckReplaceable(const std::string& root, const std::vector<std::string>& names);

// Writes each (name, text) into `root`, atomically: all are written before
// any is renamed into place, so a failure writing them changes nothing; then
// they are renamed in order, the last last.
Status WriteFilesInOrder(const std::string& root,
                         const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace reshard
