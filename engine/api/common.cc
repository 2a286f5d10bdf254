#include "api/common.h"

#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "container/dcp_item.h"
#include "container/mapped_file.h"
#include "container/torch_check.h"
#include "container/zip_directory.h"
#include "exec/executor.h"
#include "formats/format.h"
#include "rules/builtin_rules.h"
#include "util/strings.h"

namespace reshard {

std::vector<std::string> OpenNotes(const SourceCheckpoint& src, const CommonOptions& options) {
  std::vector<std::string> notes = src.info().notes;
  if (std::string note = CopiedBuiltinNameNote(options.rules); !note.empty()) notes.push_back(std::move(note));
  return notes;
}

int ThreadCount(int requested) {
  if (requested > 0) return requested;
  // The cores this process may run on: mpirun binds each rank to its own.
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1u, std::thread::hardware_concurrency());
}

Status CheckVocabSize(const SourceCheckpoint& src, std::optional<int64_t> given) {
  if (!given) return Status::Ok();
  const std::string what = "--vocab-size " + std::to_string(*given);
  if (*given < 1) return Status::InvalidInput(what + ": a vocabulary has at least one token");
  if (src.info().vocab_size && *src.info().vocab_size != *given) {
    return Status::InvalidInput(what + " contradicts the checkpoint, which records a vocabulary of " +
                                std::to_string(*src.info().vocab_size) + "; drop --vocab-size");
  }
  if (src.info().vocab_rows > 0 && *given > src.info().vocab_rows) {
    return Status::InvalidInput(what + " exceeds the " + std::to_string(src.info().vocab_rows) +
                                " rows of the checkpoint's vocabulary tensors");
  }
  return Status::Ok();
}

namespace {

bool IsTorchSaveName(const std::string& path) { return EndsWith(path, ".pt") || EndsWith(path, ".bin"); }

// The `.metadata` of each folder of `paths` holding `.distcp` files: where
// their items lie.
Result<std::map<std::string, std::shared_ptr<const DcpMetadata>>> DcpFolders(const std::vector<std::string>& paths) {
  std::map<std::string, std::shared_ptr<const DcpMetadata>> out;
  for (const std::string& path : paths) {
    const std::string folder = std::filesystem::path(path).parent_path();
    if (!EndsWith(path, ".distcp") || out.count(folder)) continue;
    RESHARD_ASSIGN_OR_RETURN(DcpMetadata meta, ReadDcpMetadata(folder + "/.metadata"));
    out[folder] = std::make_shared<const DcpMetadata>(std::move(meta));
  }
  return out;
}

// Every record of the file `path` checked against its CRC-32: a torch.save
// file's, or those of each item of a `.distcp` file (`meta`, else null).
Status CheckFileCrcs(const std::string& path, const DcpMetadata* meta, const TorchCheck* torch) {
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  if (meta != nullptr) return CheckDcpItemCrcs(*file, std::filesystem::path(path).filename(), *meta);
  RESHARD_ASSIGN_OR_RETURN(ZipDirectory directory, ZipDirectory::Read(*file));
  RESHARD_RETURN_IF_ERROR(directory.CheckCrcs(*file));
  return torch != nullptr ? torch->Check(path) : Status::Ok();
}

}  // namespace

Status CheckRecordCrcs(const SourceCheckpoint& src, int threads, const TorchCheck* torch,
                       const ProgressCallback& progress, std::vector<std::string>* damaged) {
  RESHARD_ASSIGN_OR_RETURN(auto dcp_folders, DcpFolders(src.info().files));
  std::mutex mu;
  std::vector<Job> jobs;
  for (const std::string& path : src.info().files) {
    const bool distcp = EndsWith(path, ".distcp");
    if (!IsTorchSaveName(path) && !distcp) continue;  // safetensors and JSON files keep no CRCs
    const DcpMetadata* meta = distcp ? dcp_folders.at(std::filesystem::path(path).parent_path()).get() : nullptr;
    std::error_code ec;
    const int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    const int64_t size = ec ? 0 : bytes;
    jobs.push_back({path, size, [path, size, meta, torch, damaged, &mu](JobContext& ctx) {
                      const Status st = CheckFileCrcs(path, meta, torch);
                      if (st.ok()) {
                        ctx.done(size);
                        return Status::Ok();
                      }
                      std::lock_guard<std::mutex> lock(mu);
                      damaged->push_back(st.message());
                      return Status::Ok();  // every file is checked
                    }});
  }
  ExecuteOptions exec;
  exec.threads = threads;
  exec.buffer_bytes = 0;  // the check reads the mapping, not a buffer
  exec.progress = progress;
  return Execute(jobs, exec);
}

}  // namespace reshard
