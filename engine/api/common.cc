#include "api/common.h"

#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>

#include "container/mapped_file.h"
#include "container/torch_check.h"
#include "container/zip_directory.h"
#include "exec/executor.h"
#include "formats/format.h"

namespace reshard {

int ThreadCount(int requested) {
  if (requested > 0) return requested;
  // The cores this process may run on: mpirun binds each rank to its own.
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
  return std::max(1u, std::thread::hardware_concurrency());
}

Result<OutputPlan> PlanConversion(const SourceCheckpoint& src, const ConvertOptions& options,
                                  std::vector<std::string>* notes) {
  if (options.target_ep > 0 && !src.info().has_experts) {
    return Status::InvalidInput("--ep sets the expert-parallel size of a DeepSpeed MoE checkpoint, and this " +
                                src.info().kind + " checkpoint has no experts; leave it out");
  }
  RESHARD_RETURN_IF_ERROR(CheckPipelineComputes(src));
  return src.Plan(options, notes);
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

bool IsTorchSaveName(const std::string& path) {
  auto ends_with = [&](const std::string& suffix) {
    return path.size() >= suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with(".pt") || ends_with(".bin");
}

}  // namespace

Status CheckRecordCrcs(const SourceCheckpoint& src, int threads, const TorchCheck* torch,
                       const std::function<void(const std::string&)>& progress, std::vector<std::string>* damaged) {
  std::mutex mu;
  std::vector<Job> jobs;
  for (const std::string& path : src.info().files) {
    if (!IsTorchSaveName(path)) continue;  // safetensors and JSON files keep no CRCs
    std::error_code ec;
    const int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    jobs.push_back({path, ec ? 0 : bytes, [path, torch, damaged, &mu](JobContext& ctx) {
                      Status st = [&]() -> Status {
                        RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
                        RESHARD_ASSIGN_OR_RETURN(ZipDirectory directory, ZipDirectory::Read(*file));
                        RESHARD_RETURN_IF_ERROR(directory.CheckCrcs(*file));
                        if (torch != nullptr) RESHARD_RETURN_IF_ERROR(torch->Check(path));
                        ctx.done(static_cast<int64_t>(file->size()));
                        return Status::Ok();
                      }();
                      if (!st.ok()) {
                        std::lock_guard<std::mutex> lock(mu);
                        damaged->push_back(st.message());
                      }
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
