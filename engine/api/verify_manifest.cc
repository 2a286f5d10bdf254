// reshard::VerifyManifest: an output folder against the manifest written into it.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "api/common.h"
#include "container/regular_file.h"
#include "container/write_fully.h"
#include "exec/executor.h"
#include "exec/manifest.h"
#include "formats/registry.h"
#include "reshard/reshard.h"
#include "util/crc32.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// The folder the manifest is in: `path` itself, or the checkpoint a pointer
// file in it names.
fs::path ManifestFolder(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(path / kManifestName, ec)) return path;
  return CheckpointFolder(path.string());
}

// Every file under `dir`, by its path relative to it.
std::set<std::string> FilesUnder(const fs::path& dir) {
  std::set<std::string> names;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec)) names.insert(fs::relative(it->path(), dir, ec).string());
  }
  return names;
}

// Whether `path`, with every link resolved, lies inside the folder `dir`:
// a listed name can be a link that leads out of the output.
bool ResolvesInside(const fs::path& dir, const fs::path& path) {
  std::error_code ec;
  const fs::path root = fs::canonical(dir, ec);
  const fs::path file = fs::weakly_canonical(path, ec);
  if (ec) return false;
  const auto [end, unused] = std::mismatch(root.begin(), root.end(), file.begin(), file.end());
  return end == root.end();
}

// What is wrong with the file `name` of `dir` against its entry `want` (""
// when nothing), read through `buffer`: no more than the bytes the entry
// says, and only from a regular file inside the folder.
std::string CheckFile(const fs::path& dir, const std::string& name, const FileDigest& want,
                      std::vector<uint8_t>& buffer) {
  const std::string path = (dir / name).string();
  std::error_code ec;
  if (fs::symlink_status(path, ec).type() == fs::file_type::not_found) return name + " is missing";
  if (!ResolvesInside(dir, path)) return name + " is a link that leads outside the folder; it was not read";
  Result<OpenedFile> opened = OpenRegularFile(path);
  if (!opened.ok()) return opened.status().message();
  const int fd = opened->fd;
  if (opened->st.st_size != want.bytes) {
    ::close(fd);
    return name + " has " + std::to_string(opened->st.st_size) + " bytes, the manifest " + std::to_string(want.bytes);
  }
  FileDigest have;
  int err = 0;
  while (have.bytes < want.bytes && err == 0) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buffer.size()), want.bytes - have.bytes));
    err = ReadFully(fd, buffer.data(), n, have.bytes);
    have.crc32 = Crc32(have.crc32, buffer.data(), n);
    have.bytes += static_cast<int64_t>(n);
  }
  ::close(fd);
  if (err != 0) return "cannot read " + path + ": " + std::strerror(err);
  if (have.crc32 != want.crc32) return name + ": its CRC-32 differs from the manifest's (the file is damaged)";
  return "";
}

// Each listed file's size and CRC-32, a file per job.
Status CheckFiles(const fs::path& dir, const Manifest& manifest, const CommonOptions& options,
                  ManifestReport* report) {
  std::mutex mu;
  std::vector<Job> jobs;
  for (const auto& [name, want] : manifest.files) {
    jobs.push_back({name, want.bytes, [&, name, want](JobContext& ctx) {
                      std::string problem = CheckFile(dir, name, want, ctx.buffer);
                      ctx.done(want.bytes);
                      if (!problem.empty()) {
                        std::lock_guard<std::mutex> lock(mu);
                        report->problems.push_back(std::move(problem));
                      }
                      return Status::Ok();  // every file is checked
                    }});
  }
  ExecuteOptions exec;
  exec.threads = ThreadCount(options.threads);
  exec.progress = options.progress;
  RESHARD_RETURN_IF_ERROR(Execute(jobs, exec));
  for (const std::string& name : FilesUnder(dir)) {
    if (name != kManifestName && !manifest.files.count(name)) {
      report->problems.push_back(name + " is not in the manifest (added after reshard wrote the folder)");
    }
  }
  std::sort(report->problems.begin(), report->problems.end());  // the same report whatever the threads did
  report->files_checked = static_cast<int64_t>(manifest.files.size());
  for (const auto& [name, d] : manifest.files) report->bytes_checked += d.bytes;
  return Status::Ok();
}

}  // namespace

Result<ManifestReport> VerifyManifest(const std::string& folder, const CommonOptions& options) {
  const fs::path dir = ManifestFolder(fs::path(folder));
  std::error_code ec;
  if (!fs::is_regular_file(dir / kManifestName, ec)) {
    return Status::InvalidInput(dir.string() + " has no " + kManifestName + "; `reshard verify` with one folder "
                                "checks an output reshard wrote (give two checkpoints to compare them)");
  }
  RESHARD_ASSIGN_OR_RETURN(Manifest manifest, ReadManifest((dir / kManifestName).string()));
  ManifestReport report;
  RESHARD_RETURN_IF_ERROR(CheckFiles(dir, manifest, options, &report));
  // A checkpoint reshard reads gets lint's consistency checks too (an export folder does not).
  const bool checkpoint = std::any_of(manifest.files.begin(), manifest.files.end(), [](const auto& f) {
    return f.first.find("model_states.pt") != std::string::npos;
  });
  if (!checkpoint) return report;
  Result<std::unique_ptr<SourceCheckpoint>> src = OpenCheckpoint(dir.string(), options);
  if (!src.ok()) {
    report.problems.push_back(src.status().message());
    return report;
  }
  LintOptions lint;
  static_cast<CommonOptions&>(lint) = options;
  LintReport findings;
  findings.findings = (*src)->info().findings;
  (*src)->Lint(lint, &findings);
  report.summary = (*src)->info().summary;
  for (const Finding& f : findings.findings) {
    if (f.severity == Finding::Severity::kError) report.problems.push_back(f.message);
  }
  return report;
}

}  // namespace reshard
