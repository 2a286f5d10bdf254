// reshard::VerifyManifest: an output folder against the manifest written into it.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "api/common.h"
#include "container/crc32.h"
#include "exec/executor.h"
#include "exec/manifest.h"
#include "formats/format.h"
#include "reshard/reshard.h"

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

// What is wrong with the file at `path` against its entry `want` ("" when
// nothing), read through `buffer`.
std::string CheckFile(const std::string& name, const std::string& path, const FileDigest& want,
                      std::vector<uint8_t>& buffer) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? name + " is missing" : "cannot read " + path + ": " + std::strerror(errno);
  FileDigest have;
  ssize_t n;
  while ((n = ::read(fd, buffer.data(), buffer.size())) > 0) {
    have.crc32 = Crc32(have.crc32, buffer.data(), static_cast<size_t>(n));
    have.bytes += n;
  }
  const int err = errno;
  ::close(fd);
  if (n < 0) return "cannot read " + path + ": " + std::strerror(err);
  if (have.bytes != want.bytes) {
    return name + " has " + std::to_string(have.bytes) + " bytes, the manifest " + std::to_string(want.bytes);
  }
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
                      std::string problem = CheckFile(name, (dir / name).string(), want, ctx.buffer);
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
  findings.findings = (*src)->findings();
  (*src)->Lint(lint, &findings);
  report.summary = (*src)->Summary();
  for (const Finding& f : findings.findings) {
    if (f.severity == Finding::Severity::kError) report.problems.push_back(f.message);
  }
  return report;
}

}  // namespace reshard
