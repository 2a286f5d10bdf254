// reshard::Lint: everything `convert` would object to, without writing.
#include <filesystem>
#include <mutex>

#include "api/common.h"
#include "container/mapped_file.h"
#include "container/zip_directory.h"
#include "exec/executor.h"
#include "formats/format.h"
#include "reshard/reshard.h"

namespace reshard {
namespace {

// `lint --deep`: every record of every file against its CRC-32, a file per
// job on the executor's threads; a damaged file is an error finding.
Status CheckCrcs(const SourceCheckpoint& src, const LintOptions& options, LintReport* report) {
  std::mutex mu;
  std::vector<Job> jobs;
  for (const std::string& path : src.Files()) {
    std::error_code ec;
    const int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    jobs.push_back({path, ec ? 0 : bytes, [path, report, &mu](JobContext& ctx) {
                      Status st = [&]() -> Status {
                        RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
                        RESHARD_ASSIGN_OR_RETURN(ZipDirectory directory, ZipDirectory::Read(*file));
                        RESHARD_RETURN_IF_ERROR(directory.CheckCrcs(*file));
                        ctx.done(static_cast<int64_t>(file->size()));
                        return Status::Ok();
                      }();
                      if (!st.ok()) {
                        std::lock_guard<std::mutex> lock(mu);
                        report->findings.push_back({Finding::Severity::kError, st.message()});
                      }
                      return Status::Ok();  // every file is checked
                    }});
  }
  ExecuteOptions exec;
  exec.threads = ThreadCount(options.threads);
  exec.buffer_bytes = 0;  // the check reads the mapping, not a buffer
  exec.progress = options.progress;
  return Execute(jobs, exec);
}

}  // namespace

bool LintReport::ok() const {
  for (const Finding& f : findings) {
    if (f.severity == Finding::Severity::kError) return false;
  }
  return true;
}

Result<LintReport> Lint(const std::string& checkpoint, const LintOptions& options) {
  RESHARD_ASSIGN_OR_RETURN(std::unique_ptr<SourceCheckpoint> src, OpenCheckpoint(checkpoint, options));
  RESHARD_RETURN_IF_ERROR(CheckVocabSize(*src, options.vocab_size));
  LintReport report;
  report.summary = src->Summary();
  report.findings = src->findings();
  src->Lint(options, &report);
  if (options.deep) RESHARD_RETURN_IF_ERROR(CheckCrcs(*src, options, &report));
  return report;
}

}  // namespace reshard
