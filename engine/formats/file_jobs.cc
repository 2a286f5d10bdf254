#include "formats/file_jobs.h"

#include <filesystem>
#include <fstream>
#include <memory>

#include "container/crc32.h"
#include "container/regular_file.h"
#include "container/torch_file.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// The folders `name` is in below `dir`; a name without one costs nothing.
Status MakeParentFolders(const std::string& dir, const std::string& name) {
  if (name.find('/') == std::string::npos) return Status::Ok();
  const fs::path parent = (fs::path(dir) / name).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  return ec ? Status::IoError("cannot create " + parent.string() + ": " + ec.message()) : Status::Ok();
}

// Writes `tree` as the torch.save file `name` of the job's folder.
Status WriteTree(JobContext& ctx, const std::string& name, const Value& tree) {
  RESHARD_RETURN_IF_ERROR(MakeParentFolders(ctx.dir, name));
  TorchWriteOptions write;
  write.buffer = &ctx.buffer;
  write.written = ctx.done;
  FileDigest digest;
  write.digest = &digest;
  RESHARD_RETURN_IF_ERROR(WriteTorchFile(ctx.dir + "/" + name, tree, write));
  if (ctx.wrote) ctx.wrote(name, digest);
  return Status::Ok();
}

}  // namespace

Result<Job> TorchFileJob(std::string name, Value root) {
  auto tree = std::make_shared<Value>(std::move(root));
  RESHARD_ASSIGN_OR_RETURN(int64_t bytes, TensorBytes(*tree));
  Job job;
  job.name = name;
  job.bytes = bytes;
  job.run = [name = std::move(name), tree](JobContext& ctx) { return WriteTree(ctx, name, *tree); };
  return job;
}

Result<Job> TorchFileJob(std::string name, std::function<Result<Value>()> make) {
  RESHARD_ASSIGN_OR_RETURN(Value sized, make());
  RESHARD_ASSIGN_OR_RETURN(int64_t bytes, TensorBytes(sized));
  Job job;
  job.name = name;
  job.bytes = bytes;
  job.run = [name = std::move(name), make = std::move(make)](JobContext& ctx) -> Status {
    RESHARD_ASSIGN_OR_RETURN(Value tree, make());
    return WriteTree(ctx, name, tree);
  };
  return job;
}

Job CopyFileJob(std::string name, std::string from, int64_t bytes) {
  Job job;
  job.name = name;
  job.bytes = bytes;
  job.run = [name, from = std::move(from), counted = bytes > 0](JobContext& ctx) {
    FileDigest digest;
    RESHARD_RETURN_IF_ERROR(CopyRegularFile(from, ctx.dir + "/" + name, ctx.buffer, &digest,
                                            counted ? ctx.done : std::function<void(int64_t)>()));
    if (ctx.wrote) ctx.wrote(name, digest);
    return Status::Ok();
  };
  return job;
}

Job TextFileJob(std::string name, std::string text) {
  Job job;
  job.name = name;
  job.run = [name, text = std::move(text)](JobContext& ctx) {
    const std::string path = ctx.dir + "/" + name;
    std::ofstream out(path, std::ios::trunc);
    out << text;
    out.close();
    if (!out.good()) return Status::IoError("cannot write " + path);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(text.data());
    if (ctx.wrote) ctx.wrote(name, {static_cast<int64_t>(text.size()), Crc32(0, bytes, text.size())});
    return Status::Ok();
  };
  return job;
}

}  // namespace reshard
