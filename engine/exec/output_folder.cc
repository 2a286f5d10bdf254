#include "exec/output_folder.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace reshard {
namespace fs = std::filesystem;
namespace {

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

Status WriteFileAtomically(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".reshard-tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
    if (!out.good()) return Status::IoError("cannot write " + tmp.string());
  }
  RESHARD_RETURN_IF_ERROR(SyncPath(tmp, false));
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return Status::IoError("cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
  return SyncPath(path.parent_path(), true);
}

}  // namespace

OutputFolder::OutputFolder(std::string out) : out_(std::move(out)) {
  staging_ = out_ + ".reshard-partial-" + std::to_string(::getpid());
}

OutputFolder::OutputFolder(OutputFolder&& other) noexcept
    : out_(std::move(other.out_)),
      staging_(std::move(other.staging_)),
      committed_(other.committed_) {
  other.committed_ = true;  // the moved-from object owns nothing
}

OutputFolder::~OutputFolder() {
  if (committed_ || staging_.empty()) return;
  std::error_code ec;
  fs::remove_all(staging_, ec);
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
  }
  return OutputFolder(target.string());
}

Status OutputFolder::Begin() {
  std::error_code ec;
  fs::create_directories(fs::path(out_).parent_path(), ec);
  if (ec) return Status::IoError("cannot create " + fs::path(out_).parent_path().string() + ": " + ec.message());
  fs::remove_all(staging_, ec);
  fs::create_directory(staging_, ec);
  if (ec) return Status::IoError("cannot create " + staging_ + ": " + ec.message());
  return Status::Ok();
}

Status OutputFolder::Commit() {
  // The files were flushed by SyncFiles; their names are flushed here.
  RESHARD_RETURN_IF_ERROR(SyncPath(staging_, true));
  std::error_code ec;
  const std::string old = out_ + ".reshard-old-" + std::to_string(::getpid());
  const bool replace = fs::exists(out_, ec);
  if (replace) {
    fs::rename(out_, old, ec);
    if (ec) return Status::IoError("cannot move the old " + out_ + " aside: " + ec.message());
  }
  fs::rename(staging_, out_, ec);
  if (ec) return Status::IoError("cannot rename " + staging_ + " to " + out_ + ": " + ec.message());
  committed_ = true;
  if (replace) fs::remove_all(old, ec);
  return SyncPath(fs::path(out_).parent_path(), true);
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
  std::ifstream in(from, std::ios::binary);
  std::ostringstream content;
  content << in.rdbuf();
  if (!in.good()) return Status::IoError("cannot read " + from);
  RESHARD_RETURN_IF_ERROR(WriteFileAtomically(to, content.str()));
  return true;
}

Status UpdateLatest(const std::string& root, const std::string& tag,
                    std::optional<int64_t> iteration, const std::string& file) {
  if (iteration) {
    RESHARD_RETURN_IF_ERROR(WriteFileAtomically(fs::path(root) / "latest_checkpointed_iteration.txt",
                                                std::to_string(*iteration)));
  }
  return WriteFileAtomically(fs::path(root) / file, tag);
}

}  // namespace reshard
