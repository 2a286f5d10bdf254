#include "exec/output_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "container/regular_file.h"
#include "exec/journal.h"
#include "exec/manifest.h"
#include "util/list_folder.h"
#include "util/strings.h"

namespace reshard {
namespace fs = std::filesystem;
namespace {

// `<OUT>.reshard-partial-<pid>`: the staging folder of the run with that pid.
constexpr char kStagingInfix[] = ".reshard-partial-";

bool IsInside(const fs::path& child, const fs::path& parent) {
  auto c = child.begin(), p = parent.begin();
  for (; p != parent.end(); ++c, ++p) {
    if (c == child.end() || *c != *p) return false;
  }
  return true;
}

// Absolute, symlinks resolved as far as the path exists, without `.`, `..`
// or a trailing slash.
fs::path Canonical(const std::string& path) {
  std::error_code ec;
  fs::path abs = fs::weakly_canonical(fs::absolute(path, ec), ec).lexically_normal();
  return abs.has_filename() ? abs : abs.parent_path();
}

// Flushes a file or a folder's entries to the disk: a rename is durable only
// once the folder holding it is.
Status SyncPath(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_WRONLY) | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path.string() + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::IoError("cannot sync " + path.string() + ": " + std::strerror(err));
  return Status::Ok();
}

// A file written and flushed beside its destination, not yet in place; the
// destructor removes it unless Publish moved it.
class PendingFile {
 public:
  explicit PendingFile(fs::path path)
      : path_(std::move(path)), tmp_(path_.string() + ".reshard-tmp-" + std::to_string(::getpid())) {}
  ~PendingFile() {
    std::error_code ec;
    if (!published_) fs::remove(tmp_, ec);
  }
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  Status Write(const std::string& content) {
    std::error_code ec;
    if (fs::is_directory(path_, ec)) {
      return Status::IoError("cannot replace " + path_.string() + ": it is a folder; move it away");
    }
    {
      std::ofstream out(tmp_, std::ios::trunc);
      out << content;
      if (!out.good()) return Status::IoError("cannot write " + tmp_.string());
    }
    return SyncPath(tmp_, false);
  }

  Status Publish() {
    std::error_code ec;
    fs::rename(tmp_, path_, ec);
    if (ec) return Status::IoError("cannot rename " + tmp_.string() + " to " + path_.string() + ": " + ec.message());
    published_ = true;
    return SyncPath(path_.parent_path(), true);
  }

 private:
  const fs::path path_, tmp_;
  bool published_ = false;
};

Status WriteFileAtomically(const fs::path& path, const std::string& content) {
  PendingFile file(path);
  RESHARD_RETURN_IF_ERROR(file.Write(content));
  return file.Publish();
}

// What a killed run left beside OUT: the folders `<base>.reshard-partial-<pid>`
// and `.reshard-old-<pid>`, and the PendingFiles `<file>.reshard-tmp-<pid>`
// (the files written beside OUT), whose process is gone.
bool IsLeftover(const std::string& name, const std::string& base) {
  std::string pid;
  for (const std::string kind : {kStagingInfix, ".reshard-old-"}) {
    if (name.rfind(base + kind, 0) == 0) pid = name.substr(base.size() + kind.size());
  }
  const std::string tmp = ".reshard-tmp-";
  const size_t at = name.rfind(tmp);
  if (pid.empty() && at != std::string::npos && at > 0) pid = name.substr(at + tmp.size());
  if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) return false;
  return ::kill(static_cast<pid_t>(std::stol(pid)), 0) != 0 && errno == ESRCH;
}

// The relative path of each file `manifest` lists, the manifest's own, and of
// each folder on the way to one.
struct ListedEntries {
  std::set<std::string> files, folders;
};

ListedEntries EntriesOf(const Manifest& manifest) {
  ListedEntries listed;
  listed.files.insert(kManifestName);
  for (const auto& [name, digest] : manifest.files) {
    listed.files.insert(name);
    for (size_t at = name.find('/'); at != std::string::npos; at = name.find('/', at + 1)) {
      listed.folders.insert(name.substr(0, at));
    }
  }
  return listed;
}

// The first entry under `dir` (its path relative to the output folder,
// `prefix` + name; in name order, depth first) that is neither a listed file
// nor a listed folder holding only listed entries; "" when there is none.
std::string FirstUnlisted(const fs::path& dir, const std::string& prefix, const ListedEntries& listed) {
  Result<std::vector<fs::directory_entry>> entries = ListFolder(dir.string());
  if (!entries.ok()) return prefix.empty() ? "." : prefix;  // what cannot be read is not known to be reshard's
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : *entries) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string rel = prefix + name;
    std::error_code ec;
    const bool folder = fs::is_directory(fs::symlink_status(dir / name, ec));  // a link is not followed
    if (folder && listed.folders.count(rel)) {
      const std::string first = FirstUnlisted(dir / name, rel + "/", listed);
      if (!first.empty()) return first;
    } else if (folder || !listed.files.count(rel)) {
      return rel + (folder ? "/" : "");
    }
  }
  return "";
}

// The entries of an earlier output `dir` that its manifest lists ({} when it
// has none; an unreadable manifest lists nothing).
ListedEntries ListedIn(const fs::path& dir) {
  std::error_code ec;
  const fs::path manifest = dir / kManifestName;
  if (!fs::exists(fs::symlink_status(manifest, ec))) return {};
  Result<Manifest> read = ReadManifest(manifest.string());
  return read.ok() ? EntriesOf(*read) : ListedEntries{};
}

// `text` without the white space around it.
std::string Trimmed(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t\r\n") - begin + 1);
}

// A pointer's content for a message: quoted, cut short, bytes that are not
// printable as '?'.
std::string Shown(const std::string& text) {
  constexpr size_t kShown = 60;
  std::string out;
  for (size_t i = 0; i < std::min(text.size(), kShown); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return "'" + out + (text.size() > kShown ? "...'" : "'");
}

// Whether `folder` holds one of `markers`: a checkpoint root.
bool HoldsMarker(const fs::path& folder, const std::vector<std::string>& markers) {
  for (const std::string& marker : markers) {
    std::error_code ec;
    if (fs::exists(fs::symlink_status(folder / marker, ec))) return true;
  }
  return false;
}

// The names `publication` writes into a root: its pointers and copies.
std::vector<std::string> PublishedNames(const Publication& publication) {
  std::vector<std::string> names;
  for (const PointerFile& pointer : publication.pointers) names.push_back(pointer.name);
  for (const std::string& from : publication.copies) names.push_back(fs::path(from).filename().string());
  return names;
}

// Whether the folder `parent` of the output `name` was made for it: absent
// (this run makes it), or holding something and nothing but the output, what
// `publication` writes beside it and what runs writing it leave (their
// staging folders, lock and temporary files), as when a killed run made it.
// Not an empty folder the user made, and never the current folder, which a
// bare OUT name does not make a root.
bool MadeForOutput(const fs::path& parent, const std::string& name, const Publication& publication) {
  std::error_code ec;
  if (!fs::exists(parent, ec)) return true;
  if (fs::equivalent(parent, fs::current_path(ec), ec)) return false;
  Result<std::vector<fs::directory_entry>> entries = ListFolder(parent.string());
  if (!entries.ok()) return false;
  const std::vector<std::string> published = PublishedNames(publication);
  std::set<std::string> own(published.begin(), published.end());
  own.insert({name, "." + name + ".reshard-lock"});
  for (const fs::directory_entry& entry : *entries) {
    const std::string entry_name = entry.path().filename().string();
    const bool left = entry_name.rfind(name + ".reshard-", 0) == 0 || entry_name.find(".reshard-tmp-") != std::string::npos;
    if (!own.count(entry_name) && !left) return false;
  }
  return !entries->empty();
}

// The staging folders and lock files of outputs in progress, for
// RemoveStagingFolders, and whether it has run: publishing holds the same
// mutex, so an interrupt finds each output either published whole or never.
std::mutex staging_mu;
bool interrupted = false;
std::set<std::string>& StagingFolders() {
  static std::set<std::string>* folders = new std::set<std::string>;  // never destroyed: used at exit
  return *folders;
}

void Track(const std::string& path, bool in_progress) {
  std::lock_guard<std::mutex> lock(staging_mu);
  if (in_progress) {
    StagingFolders().insert(path);
  } else {
    StagingFolders().erase(path);
  }
}

// Renames `staging` to `out`, or exchanges the two when OUT exists (so at
// every instant OUT is the old folder or the new), unless an interrupt is
// removing the staging folders: publishing it then would publish a folder
// whose files are being removed.
Status MoveIntoPlace(const std::string& staging, const std::string& out, bool exchange) {
  std::lock_guard<std::mutex> lock(staging_mu);
  if (interrupted) return Status::IoError("interrupted before " + out + " was published");
  if (exchange) {
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
      return Status::IoError("cannot exchange " + staging + " with " + out + ": " + std::strerror(errno));
    }
  } else {
    std::error_code ec;
    fs::rename(staging, out, ec);
    if (ec) return Status::IoError("cannot rename " + staging + " to " + out + ": " + ec.message());
  }
  StagingFolders().erase(staging);
  return Status::Ok();
}

}  // namespace

std::vector<std::string> RemoveStagingFolders() {
  std::lock_guard<std::mutex> lock(staging_mu);
  interrupted = true;
  std::vector<std::string> outs;
  for (const std::string& staging : StagingFolders()) {
    const size_t infix = staging.rfind(kStagingInfix);
    if (infix != std::string::npos) outs.push_back(staging.substr(0, infix));  // not for a lock file
    // Workers may still be creating files in it: a pass that meets one fails
    // (the folder is not empty when it is removed), so pass again.
    std::error_code ec;
    for (int pass = 0; pass < 1000 && fs::exists(staging, ec); ++pass) fs::remove_all(staging, ec);
  }
  return outs;
}

OutputFolder::OutputFolder(std::string out) : out_(std::move(out)) {
  staging_ = out_ + kStagingInfix + std::to_string(::getpid());
}

OutputFolder::OutputFolder(OutputFolder&& other) noexcept
    : out_(std::move(other.out_)),
      staging_(std::move(other.staging_)),
      overwrite_(other.overwrite_),
      committed_(other.committed_),
      lock_fd_(other.lock_fd_),
      created_parents_(std::move(other.created_parents_)),
      leftovers_(std::move(other.leftovers_)),
      resumed_(std::move(other.resumed_)),
      kept_(std::move(other.kept_)) {
  other.committed_ = true;  // the moved-from object owns nothing
  other.lock_fd_ = -1;
}

OutputFolder::~OutputFolder() {
  std::error_code ec;
  if (!committed_ && !staging_.empty()) {
    fs::remove_all(staging_, ec);
    Track(staging_, false);
  }
  Unlock();
  if (committed_) return;
  // A failed run leaves no folder it made (fs::remove keeps one that is not empty).
  for (const std::string& parent : created_parents_) fs::remove(parent, ec);
}

std::string OutputFolder::LockPath() const {
  const fs::path out(out_);
  return (out.parent_path() / ("." + out.filename().string() + ".reshard-lock")).string();
}

Status OutputFolder::Lock() {
  const std::string path = LockPath();
  lock_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) return Status::IoError("cannot create " + path + ": " + std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock_fd_);
    lock_fd_ = -1;
    return Status::InvalidInput("another reshard is writing " + out_ + " (it holds " + path +
                                "); wait for it to finish or choose another output folder");
  }
  Track(path, true);
  return Status::Ok();
}

void OutputFolder::Unlock() {
  if (lock_fd_ < 0) return;
  ::unlink(LockPath().c_str());  // while still held, so no other run takes a removed file
  Track(LockPath(), false);
  ::close(lock_fd_);
  lock_fd_ = -1;
}

Status OutputFolder::CheckStillReplaceable() const {
  std::error_code ec;
  if (!fs::exists(out_, ec) || fs::is_empty(out_, ec)) return Status::Ok();
  if (overwrite_) return CheckOverwritable(out_);
  return Status::InvalidInput("the output folder " + out_ +
                              " is no longer empty (something wrote into it during this run); "
                              "pass --overwrite to replace it");
}

void OutputFolder::RemoveLeftovers(const std::string& fingerprint) {
  const fs::path out(out_);
  Result<std::vector<fs::directory_entry>> entries = ListFolder(out.parent_path().string());
  if (!entries.ok()) return;
  for (const fs::directory_entry& entry : *entries) {
    const std::string name = entry.path().filename().string();
    if (!IsLeftover(name, out.filename().string())) continue;
    std::error_code ec;
    const bool same_run = !fingerprint.empty() && resumed_.empty() &&
                          name.rfind(out.filename().string() + kStagingInfix, 0) == 0 &&
                          HoldsJournalOf(entry.path().string(), fingerprint);
    if (same_run) {
      fs::rename(entry.path(), staging_, ec);
      if (!ec) {
        resumed_ = name;
        continue;
      }
    }
    fs::remove_all(entry.path(), ec);
    if (!ec) leftovers_.push_back(name);
  }
}

Result<OutputFolder> OutputFolder::Check(const std::string& out, const std::vector<std::string>& inputs,
                                         bool overwrite) {
  const fs::path target = Canonical(out);
  if (target.filename().empty()) return Status::InvalidInput("the output path '" + out + "' names no folder");
  for (const std::string& in : inputs) {
    const fs::path input = Canonical(in);
    if (IsInside(target, input) || IsInside(input, target)) {
      return Status::InvalidInput("the output folder " + target.string() +
                                  " overlaps the input checkpoint " + input.string() +
                                  "; choose a separate folder (the input is never modified)");
    }
  }
  std::error_code ec;
  if (fs::exists(target, ec)) {
    if (!fs::is_directory(target, ec)) {
      return Status::InvalidInput("the output path " + target.string() + " is a file; choose a folder");
    }
    if (!fs::is_empty(target, ec) && !overwrite) {
      return Status::InvalidInput("the output folder " + target.string() +
                                  " is not empty; pass --overwrite to replace it");
    }
    if (overwrite) RESHARD_RETURN_IF_ERROR(CheckOverwritable(target.string()));
  }
  OutputFolder folder(target.string());
  folder.overwrite_ = overwrite;
  return folder;
}

Status OutputFolder::Begin(const std::string& fingerprint) {
  std::error_code ec;
  for (fs::path p = fs::path(out_).parent_path(); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created_parents_.push_back(p.string());
  }
  fs::create_directories(fs::path(out_).parent_path(), ec);
  if (ec) return Status::IoError("cannot create " + fs::path(out_).parent_path().string() + ": " + ec.message());
  RESHARD_RETURN_IF_ERROR(Lock());
  RESHARD_RETURN_IF_ERROR(CheckStillReplaceable());
  fs::remove_all(staging_, ec);
  RemoveLeftovers(fingerprint);
  Track(staging_, true);
  if (!resumed_.empty()) return Status::Ok();
  fs::create_directory(staging_, ec);
  if (ec) return Status::IoError("cannot create " + staging_ + ": " + ec.message());
  return Status::Ok();
}

Status OutputFolder::Commit() {
  // The files were flushed by SyncFiles; their names are flushed here.
  RESHARD_RETURN_IF_ERROR(SyncPath(staging_, true));
  RESHARD_RETURN_IF_ERROR(CheckStillReplaceable());
  std::error_code ec;
  const bool exchange = fs::exists(out_, ec);
  RESHARD_RETURN_IF_ERROR(MoveIntoPlace(staging_, out_, exchange));
  committed_ = true;
  if (exchange) RemoveOld(staging_);  // now the old OUT
  RESHARD_RETURN_IF_ERROR(SyncPath(fs::path(out_).parent_path(), true));
  Unlock();
  return Status::Ok();
}

void OutputFolder::RemoveOld(const std::string& old) {
  const ListedEntries listed = ListedIn(old);
  std::error_code ec;
  for (const std::string& name : listed.files) fs::remove(fs::path(old) / name, ec);
  // Deepest first: a folder's path is longer than its parent's.
  std::vector<std::string> folders(listed.folders.begin(), listed.folders.end());
  std::sort(folders.begin(), folders.end(), [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  for (const std::string& folder : folders) fs::remove(fs::path(old) / folder, ec);  // only when empty
  fs::remove(old, ec);
  if (!fs::exists(old, ec)) return;
  // Something no reshard run wrote was put into OUT while this run wrote:
  // kept under a name no later run removes as a leftover.
  kept_ = out_ + ".reshard-kept-" + std::to_string(::getpid());
  fs::rename(old, kept_, ec);
  if (ec) kept_ = old;
}

Status CheckOverwritable(const std::string& dir) {
  std::error_code ec;
  if (fs::is_empty(dir, ec) && !ec) return Status::Ok();
  const fs::path manifest = fs::path(dir) / kManifestName;
  ListedEntries listed;
  if (fs::exists(fs::symlink_status(manifest, ec))) {
    Result<Manifest> read = ReadManifest(manifest.string());
    if (!read.ok()) {
      return Status::InvalidInput("--overwrite replaces only what a reshard run wrote, as its manifest lists, and " +
                                  read.status().message() + "; move the folder away or choose another output folder");
    }
    listed = EntriesOf(*read);
  }
  const std::string first = FirstUnlisted(dir, "", listed);
  if (first.empty()) return Status::Ok();
  const std::string why = listed.files.empty() ? "it has no " + std::string(kManifestName) + " saying a reshard run wrote it"
                                               : "its " + std::string(kManifestName) + " does not list it";
  return Status::InvalidInput("will not overwrite " + dir + ": it holds " + first + ", which no reshard run wrote (" +
                              why + "); --overwrite replaces only an earlier reshard output or an empty folder, so "
                              "move " + first + " away or choose another output folder");
}

OutputPlace PlaceOutput(const std::string& out, const Publication& publication) {
  OutputPlace place;
  const fs::path given = Canonical(out);
  const std::string& tag = publication.output_subfolder;
  if (!tag.empty() && given.filename().string() != tag) {
    place.folder = (given / tag).string();
    place.root = given.string();
    return place;
  }
  place.folder = given.string();
  if (!tag.empty()) {
    place.notes.push_back(out + " is named as the source's tag: it is written as that tag folder, not as a root "
                          "holding " + (fs::path(out) / tag).string());
  }
  const fs::path parent = given.parent_path();
  const std::vector<std::string> published = PublishedNames(publication);
  if (published.empty() || HoldsMarker(parent, publication.root_markers) ||
      MadeForOutput(parent, given.filename().string(), publication)) {
    place.root = parent.string();
    return place;
  }
  std::error_code ec;
  const bool here = fs::equivalent(parent, fs::current_path(ec), ec);
  place.notes.push_back(Join(published, ", ") + " not written into " + parent.string() +
                        (here ? " (the current folder)" : "") + ": it is not a checkpoint root, and this run did "
                        "not make it; give OUT inside a root or a new folder to have them written");
  return place;
}

std::vector<std::pair<std::string, std::string>> PointerTexts(const Publication& publication,
                                                              const std::string& folder) {
  std::vector<std::pair<std::string, std::string>> texts;
  for (const PointerFile& pointer : publication.pointers) {
    texts.emplace_back(pointer.name, pointer.text.value_or(fs::path(folder).filename().string()));
  }
  return texts;
}

Status CheckPointers(const std::string& root, const std::vector<std::pair<std::string, std::string>>& pointers,
                     bool overwrite) {
  for (const auto& [name, text] : pointers) {
    const fs::path path = fs::path(root) / name;
    std::error_code ec;
    if (fs::is_directory(fs::symlink_status(path, ec))) {
      return Status::InvalidInput("cannot replace " + path.string() + ": it is a folder; move it away");
    }
  }
  // Readers follow the last pointer: it is the one named when several differ.
  for (auto it = pointers.rbegin(); it != pointers.rend(); ++it) {
    const auto& [name, text] = *it;
    const fs::path path = fs::path(root) / name;
    std::error_code ec;
    if (overwrite || !fs::exists(fs::symlink_status(path, ec))) continue;
    Result<std::string> held = ReadRegularFile(path.string(), 4096);
    if (!held.ok()) {
      return Status::InvalidInput("will not replace " + path.string() + " (" + held.status().message() +
                                  "); pass --overwrite to replace it");
    }
    if (Trimmed(*held) == text) continue;
    return Status::InvalidInput(path.string() + " names " + Shown(Trimmed(*held)) + ", not this output's '" + text +
                                "': the next resume follows it, so it is replaced only with --overwrite (or write "
                                "the output elsewhere)");
  }
  return Status::Ok();
}

Status SyncFiles(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + dir + " to sync it: " + std::strerror(errno));
  const int rc = ::syncfs(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::IoError("cannot sync the files in " + dir + ": " + std::strerror(err));
  return Status::Ok();
}

Result<bool> CopyIntoRoot(const std::string& from, const std::string& root) {
  const fs::path to = fs::path(root) / fs::path(from).filename();
  std::error_code ec;
  if (fs::exists(to, ec)) return false;
  RESHARD_ASSIGN_OR_RETURN(std::string content, ReadRegularFile(from));
  RESHARD_RETURN_IF_ERROR(WriteFileAtomically(to, content));
  return true;
}

Status WriteFilesInOrder(const std::string& root,
                         const std::vector<std::pair<std::string, std::string>>& files) {
  std::deque<PendingFile> pending;  // not movable: a deque keeps them in place
  for (const auto& [name, text] : files) {
    pending.emplace_back(fs::path(root) / name);
    RESHARD_RETURN_IF_ERROR(pending.back().Write(text));
  }
  for (PendingFile& file : pending) RESHARD_RETURN_IF_ERROR(file.Publish());
  return Status::Ok();
}

}  // namespace reshard
