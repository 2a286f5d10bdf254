// OutputFolder: makes a converted checkpoint appear atomically, and only
// where the user said.
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
//
// `--overwrite` replaces only what an earlier reshard run wrote (the files its
// manifest lists) or an empty folder; nothing else is ever removed. The
// pointer files a format writes beside a tag folder (DeepSpeed's `latest`)
// go only into a root the user named (PlaceOutput), and one there that names
// another checkpoint is replaced only with `--overwrite` (CheckPointers): the
// next resume follows it.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "plan/output_plan.h"
#include "reshard/status.h"

namespace reshard {

class OutputFolder {
 public:
  // Checks that `out` may be written: it neither contains nor lies inside any
  // of `inputs`, and it is absent or empty, or with `overwrite` holds only
  // what a reshard run wrote (CheckOverwritable). Creates nothing.
  static Result<OutputFolder> Check(const std::string& out, const std::vector<std::string>& inputs,
                                    bool overwrite);

  OutputFolder(OutputFolder&& other) noexcept;
  OutputFolder& operator=(OutputFolder&&) = delete;
  ~OutputFolder();  // removes the staging folder and the parents Begin made, unless committed

  // Takes the lock on OUT (a second run writing OUT is refused until this
  // one ends), re-checks that OUT may still be replaced, removes what killed runs
  // left beside OUT, and creates the staging folder (and OUT's parents).
  // When `fingerprint` is set and a killed run's staging folder holds the
  // journal of a run with that fingerprint, that folder becomes this run's
  // staging folder instead (RunJournal says what in it can be reused).
  Status Begin(const std::string& fingerprint = "");
  const std::string& staging_dir() const { return staging_; }
  // Moves the staging folder to OUT: a rename, or with an old OUT one atomic
  // exchange, after which the files of the old folder that its manifest lists
  // are removed. Releases the lock.
  Status Commit();

  const std::string& path() const { return out_; }
  // The staging folders of killed runs that Begin removed (names in OUT's parent).
  const std::vector<std::string>& leftovers() const { return leftovers_; }
  // The killed run's staging folder Begin took over ("" when none).
  const std::string& resumed() const { return resumed_; }
  // Where Commit kept the old OUT because something no reshard run wrote
  // appeared in it during this run ("" when it was removed).
  const std::string& kept() const { return kept_; }

 private:
  explicit OutputFolder(std::string out);
  std::string LockPath() const;  // `.<OUT name>.reshard-lock` beside OUT
  Status Lock();
  void Unlock();
  Status CheckStillReplaceable() const;
  void RemoveLeftovers(const std::string& fingerprint);
  void RemoveOld(const std::string& old);

  std::string out_;
  std::string staging_;
  bool overwrite_ = false;
  bool committed_ = false;
  int lock_fd_ = -1;
  std::vector<std::string> created_parents_;  // by Begin, deepest first
  std::vector<std::string> leftovers_;
  std::string resumed_;
  std::string kept_;
};

// Refuses the folder `dir` as what `--overwrite` replaces unless it is empty
// or every entry in it is a file its reshard-manifest.json lists, the
// manifest, or a folder on the way to such files: the refusal names the
// first other entry (in name order). Replacing it would delete a file no
// reshard run wrote.
Status CheckOverwritable(const std::string& dir);

// Where a plan's output goes, from OUT as given and the plan's publication.
struct OutputPlace {
  std::string folder;  // the output folder
  // The folder that gets the publication's copies and pointers; "" when
  // none may be written (then `notes` says so).
  std::string root;
  std::vector<std::string> notes;
};

// A root given as the input gives a root: the output is OUT/<tag> and OUT
// the root, unless OUT is itself named as the tag (then OUT is the tag
// folder: never OUT/<tag>/<tag>, which no reader finds). A tag folder's
// root is its parent when that already is a checkpoint root (it holds one
// of the publication's `root_markers`), or when the run makes it, or when it
// holds nothing but this output and what runs writing it leave (a killed run
// made it); never an empty folder the user made, nor the current folder
// merely because OUT was a bare name.
OutputPlace PlaceOutput(const std::string& out, const Publication& publication);

// The (name, text) of each pointer `publication` writes beside the output
// folder `folder`: a pointer without text holds the folder's name.
std::vector<std::pair<std::string, std::string>> PointerTexts(const Publication& publication,
                                                              const std::string& folder);

// Refuses before anything is written when a pointer of `pointers` in `root`
// could not be replaced (a folder or another non-file stands there), or,
// unless `overwrite`, names another checkpoint than this run's: the refusal
// says what it names.
Status CheckPointers(const std::string& root, const std::vector<std::pair<std::string, std::string>>& pointers,
                     bool overwrite);

// Removes the staging folders and lock files of every OutputFolder begun
// and not yet committed or destroyed in this process (for an interrupted run);
// returns the output folders they were for.
std::vector<std::string> RemoveStagingFolders();

// Flushes every file written into `dir` (a staging folder) to the disk. One
// flush of the file system after all writes lets the kernel write back in
// bulk; a flush per file would wait for the disk between files. Every
// process that wrote files calls it before the folder is committed.
Status SyncFiles(const std::string& dir);

// Copies the file `from` into folder `root` under its own name, atomically,
// unless `root` has a file of that name already (it is left alone).
// Returns whether it copied.
Result<bool> CopyIntoRoot(const std::string& from, const std::string& root);

// Writes each (name, text) into `root`, atomically: all are written before
// any is renamed into place, so a failure writing them changes nothing; then
// they are renamed in order, the last last.
Status WriteFilesInOrder(const std::string& root,
                         const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace reshard
