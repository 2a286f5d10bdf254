#include "exec/plan_writer.h"

#include <filesystem>
#include <fstream>

#include "container/record_crc.h"
#include "container/regular_file.h"
#include "container/torch_file.h"
#include "util/crc32.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// The folders `name` is in below `dir`, never `dir` itself: a staging folder
// an interrupt removed stays removed. A name without one costs nothing.
Status MakeParentFolders(const std::string& dir, const std::string& name) {
  fs::path folder = dir;
  for (const fs::path& part : fs::path(name).parent_path()) {
    folder /= part;
    std::error_code ec;
    fs::create_directory(folder, ec);
    if (ec) return Status::IoError("cannot create " + folder.string() + ": " + ec.message());
  }
  return Status::Ok();
}

Status WriteTorch(JobContext& ctx, const PlannedFile& file) {
  RESHARD_ASSIGN_OR_RETURN(Value tree, file.tree());
  TorchWriteOptions write;
  write.buffer = &ctx.buffer;
  write.written = ctx.done;
  FileDigest digest;
  write.digest = &digest;
  RESHARD_RETURN_IF_ERROR(WriteTorchFile(ctx.dir + "/" + file.name, tree, write));
  if (ctx.wrote) ctx.wrote(file.name, digest);
  return Status::Ok();
}

Status WriteText(JobContext& ctx, const PlannedFile& file) {
  const std::string path = ctx.dir + "/" + file.name;
  std::ofstream out(path, std::ios::trunc);
  out << file.text;
  out.close();
  if (!out.good()) return Status::IoError("cannot write " + path);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(file.text.data());
  if (ctx.wrote) ctx.wrote(file.name, {static_cast<int64_t>(file.text.size()), Crc32(0, bytes, file.text.size())});
  return Status::Ok();
}

// A checkpoint file copied whole has its records checked as the copy reads
// them, as those of a file it is written from are (container/record_crc.h).
Status WriteCopy(JobContext& ctx, const PlannedFile& file) {
  FileDigest digest;
  SeenBytes check;
  if (std::shared_ptr<RecordCrcs> crcs = RecordCrcsOf(file.copy_of)) {
    check = [crcs](int64_t offset, const uint8_t* bytes, size_t n) {
      return crcs->NoteBytes(static_cast<uint64_t>(offset), bytes, n);
    };
  }
  RESHARD_RETURN_IF_ERROR(CopyRegularFile(file.copy_of, ctx.dir + "/" + file.name, ctx.buffer, &digest,
                                          file.bytes > 0 ? ctx.done : std::function<void(int64_t)>(), check));
  if (ctx.wrote) ctx.wrote(file.name, digest);
  return Status::Ok();
}

// A torch file that holds a source file's content is a copy of that file
// (which a file system with reflinks clones).
Status WriteTorchOrCopy(JobContext& ctx, const PlannedFile& file) {
  if (!file.copy_of.empty() && file.copy_holds && file.copy_holds()) return WriteCopy(ctx, file);
  return WriteTorch(ctx, file);
}

Status WriteSafetensorsPart(JobContext& ctx, const PlannedFile& file, int64_t begin, int64_t end) {
  const SafetensorsContent& content = *file.safetensors;
  RESHARD_ASSIGN_OR_RETURN(FileDigest piece,
                           WriteSafetensorsRange(ctx.dir + "/" + file.name, content.layout, content.tensors, begin,
                                                 end, &ctx.buffer, ctx.done));
  if (ctx.wrote) ctx.wrote(file.name, piece);
  return Status::Ok();
}

Status WriteDcpPart(JobContext& ctx, const PlannedFile& file, size_t first, size_t last) {
  RESHARD_ASSIGN_OR_RETURN(FileDigest piece, WriteDcpItems(ctx.dir + "/" + file.name, file.dcp->layout, first,
                                                           last, &ctx.buffer, ctx.done));
  if (ctx.wrote) ctx.wrote(file.name, piece);
  return Status::Ok();
}

// Each job first names the output's folder to the plan's scratch folder and
// makes the folders its file lies in.
Job FileJob(const std::shared_ptr<const PlannedFile>& file, const std::shared_ptr<ScratchFolder>& scratch,
            int64_t bytes, int part, std::function<Status(JobContext&)> write) {
  auto run = [file, scratch, write = std::move(write)](JobContext& ctx) -> Status {
    if (scratch) scratch->Use(ctx.dir);
    RESHARD_RETURN_IF_ERROR(MakeParentFolders(ctx.dir, file->name));
    return write(ctx);
  };
  return Job{file->name, bytes, std::move(run), part};
}

void AddJobs(const std::shared_ptr<const PlannedFile>& file, const std::shared_ptr<ScratchFolder>& scratch,
             std::vector<Job>* jobs) {
  const PlannedFile& f = *file;
  switch (f.container) {
    case PlannedFile::Container::kTorch:
      jobs->push_back(FileJob(file, scratch, f.bytes, 0, [&f](JobContext& ctx) { return WriteTorchOrCopy(ctx, f); }));
      return;
    case PlannedFile::Container::kText:
      jobs->push_back(FileJob(file, scratch, 0, 0, [&f](JobContext& ctx) { return WriteText(ctx, f); }));
      return;
    case PlannedFile::Container::kCopy:
      jobs->push_back(FileJob(file, scratch, f.bytes, 0, [&f](JobContext& ctx) { return WriteCopy(ctx, f); }));
      return;
    case PlannedFile::Container::kSafetensors: {
      const std::vector<int64_t>& cuts = f.safetensors->cuts;
      const auto header = static_cast<int64_t>(f.safetensors->layout.prefix.size());
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        const int64_t begin = cuts[i], end = cuts[i + 1];
        jobs->push_back(FileJob(file, scratch, end - std::max(begin, header), static_cast<int>(i),
                                [&f, begin, end](JobContext& ctx) { return WriteSafetensorsPart(ctx, f, begin, end); }));
      }
      return;
    }
    case PlannedFile::Container::kDcp: {
      const std::vector<size_t>& cuts = f.dcp->cuts;
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        const size_t first = cuts[i], last = cuts[i + 1];
        jobs->push_back(FileJob(file, scratch, DcpTensorBytes(f.dcp->layout, first, last), static_cast<int>(i),
                                [&f, first, last](JobContext& ctx) { return WriteDcpPart(ctx, f, first, last); }));
      }
      return;
    }
  }
}

}  // namespace

std::vector<Job> PlanJobs(const OutputPlan& plan) {
  std::vector<Job> jobs;
  for (const PlannedFile& f : plan.files) AddJobs(std::make_shared<const PlannedFile>(f), plan.scratch, &jobs);
  return jobs;
}

}  // namespace reshard
