#include "formats/dcp/dcp_source.h"

#include <sys/stat.h>

#include <map>
#include <regex>

#include "container/dcp_item.h"
#include "container/dcp_metadata.h"
#include "container/json_reader.h"
#include "container/mapped_file.h"
#include "container/regular_file.h"
#include "plan/materialize.h"
#include "plan/slicing.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

constexpr char kMetadataFile[] = ".metadata";
constexpr char kLatestIterationFile[] = "latest_checkpointed_iteration.txt";

bool IsDcpFolder(const std::string& path) {
  struct stat st;
  return ::stat((path + "/" + kMetadataFile).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string FirstWord(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_first_of(" \t\r\n", begin) - begin);
}

// Megatron-Core's `torch_dist` folders say so in metadata.json.
bool IsTorchDist(const std::string& folder) {
  Result<std::string> text = ReadRegularFile(folder + "/metadata.json", 1 << 16);
  if (!text.ok()) return false;
  Result<Value> json = ParseJson(*text, folder + "/metadata.json");
  const Value* backend = json.ok() ? Find(*json, "sharded_backend") : nullptr;
  return backend != nullptr && backend->is(Value::Kind::kString) && backend->as_string() == "torch_dist";
}

// A tensor item with its chunks read: each a shard placed at its box.
struct DcpTensor {
  std::string fqn;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> size;
  std::vector<SourceShard> shards;
};

// The iteration Megatron-LM names its folder after (iter_0000010); 0 else.
int64_t IterationOfFolder(const std::string& folder) {
  static const std::regex iter(".*iter_([0-9]+)/?$");
  std::smatch m;
  int64_t iteration = 0;
  return std::regex_match(folder, m, iter) && ParseInt(m[1].str(), &iteration) ? iteration : 0;
}

class DcpSource : public SourceCheckpoint {
 public:
  static Result<std::unique_ptr<SourceCheckpoint>> Open(const std::string& folder) {
    auto src = std::unique_ptr<DcpSource>(new DcpSource(folder));
    RESHARD_ASSIGN_OR_RETURN(src->meta_, ReadDcpMetadata(folder + "/" + kMetadataFile));
    RESHARD_RETURN_IF_ERROR(src->ReadChunks());
    src->SetInfo();
    return std::unique_ptr<SourceCheckpoint>(std::move(src));
  }

  // The chunks were read and checked when the checkpoint was opened; what
  // convert would object to is that no rule set describes the tensors.
  void Lint(const LintOptions&, LintReport* report) const override {
    report->findings.push_back({Finding::Severity::kInfo,
                                "DCP: every chunk of the " + Count(static_cast<int64_t>(tensors_.size()), "tensor") +
                                    " read from its .distcp window and placed in its tensor, which the chunks tile"});
    report->findings.push_back({Finding::Severity::kError, NoRulesRefusal()});
  }

  std::string Describe() const override {
    std::string out = "tensors (global shapes; chunks as offsets + sizes):\n";
    for (const DcpTensor& t : tensors_) {
      out += "  " + t.fqn + " " + DTypeName(t.dtype) + ShapeString(t.size) + ", " +
             Count(static_cast<int64_t>(t.shards.size()), "chunk") + ":";
      for (const SourceShard& s : t.shards) {
        out += " " + ShapeString(s.placements[0].global.offsets) + "+" + ShapeString(s.shape);
      }
      out += "\n";
    }
    if (bytes_items_.empty()) return out;
    out += "bytes items (pickled objects):\n";
    for (const std::string& fqn : bytes_items_) out += "  " + fqn + "\n";
    return out;
  }

  Result<OutputPlan> Plan(const ConvertOptions&, std::vector<std::string>*) const override {
    return Status::Unsupported(NoRulesRefusal());
  }

  // Each tensor whole, under its key.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy, std::atomic<int64_t>* read) const override {
    std::vector<FullTensor> out;
    for (const DcpTensor& t : tensors_) {
      TensorPlan whole;
      whole.shape = t.size;
      whole.cut_axis = -1;
      const Box all = Box::Whole(t.size);
      whole.copies = IntersectPlacements({Placement{all, std::vector<int64_t>(t.size.size(), 0)}}, t.shards, all);
      out.push_back({"weights", t.fqn, t.fqn, "", "", t.dtype, t.size, false,
                     RangeProducer(SourceTensor{t.dtype, t.shards}, std::move(whole), read)});
    }
    return out;
  }

 private:
  explicit DcpSource(std::string folder) : folder_(std::move(folder)) {}

  std::string NoRulesRefusal() const {
    return "convert writes a layout its model family's rules describe, and " + folder_ +
           " is a Distributed Checkpoint read without a rule set; export --to consolidated writes its tensors whole";
  }

  Result<std::shared_ptr<const MappedFile>> File(const std::string& name) {
    auto it = files_.find(name);
    if (it != files_.end()) return it->second;
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(folder_ + "/" + name));
    files_.emplace(name, file);
    return file;
  }

  Status ReadChunks() {
    for (const auto& [fqn, item] : meta_.items) {
      if (item.kind == DcpItem::Kind::kBytes) {
        bytes_items_.push_back(fqn);
        continue;
      }
      DcpTensor t{fqn, item.dtype, item.size, {}};
      for (const DcpChunk& chunk : item.chunks) {
        RESHARD_ASSIGN_OR_RETURN(SourceShard shard, ReadChunk(fqn, chunk));
        t.shards.push_back(std::move(shard));
      }
      tensors_.push_back(std::move(t));
    }
    return Status::Ok();
  }

  Result<SourceShard> ReadChunk(const std::string& fqn, const DcpChunk& chunk) {
    const DcpStorage& where = *meta_.Find(fqn, chunk.offsets);  // ReadDcpMetadata checked it is there
    RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, File(where.relative_path));
    RESHARD_ASSIGN_OR_RETURN(Value tensor, ReadDcpChunk(file, meta_, fqn, chunk));
    SourceShard shard = SourceShard::Of(tensor.as_tensor(), ShardCoords{});
    shard.placements = {Placement{Box{chunk.offsets, chunk.sizes}, std::vector<int64_t>(chunk.sizes.size(), 0)}};
    return shard;
  }

  void SetInfo() {
    info_.kind = "DCP";
    info_.tag_dir = folder_;
    info_.files.push_back(folder_ + "/" + kMetadataFile);
    for (const auto& [name, file] : files_) info_.files.push_back(folder_ + "/" + name);
    info_.iteration = IterationOfFolder(folder_);
    info_.summary = Summary();
  }

  std::string Summary() const {
    int64_t chunks = 0, bytes = 0;
    for (const DcpTensor& t : tensors_) {
      chunks += static_cast<int64_t>(t.shards.size());
      bytes += Box::Whole(t.size).numel() * ElementSize(t.dtype);
    }
    std::string s = IsTorchDist(folder_) ? "Megatron-Core torch_dist checkpoint" : "PyTorch Distributed Checkpoint";
    if (info_.iteration > 0) s += "; iteration " + std::to_string(info_.iteration);
    return s + "; " + Count(static_cast<int64_t>(tensors_.size()), "tensor") + " in " + Count(chunks, "chunk") +
           " (" + HumanBytes(bytes) + "), " + Count(static_cast<int64_t>(bytes_items_.size()), "bytes item") + ", " +
           Count(static_cast<int64_t>(files_.size()), ".distcp file") + "; no rule set";
  }

  const std::string folder_;
  DcpMetadata meta_;
  std::map<std::string, std::shared_ptr<const MappedFile>> files_;  // by name in the folder
  std::vector<DcpTensor> tensors_;
  std::vector<std::string> bytes_items_;
};

}  // namespace

std::string DcpCheckpointFolder(const std::string& path) {
  if (IsDcpFolder(path)) return path;
  // Megatron-LM's root: the file holds the iteration ("release" for a
  // released model), whose folder is iter_%07d.
  Result<std::string> latest = ReadRegularFile(path + "/" + kLatestIterationFile, 64);
  if (!latest.ok()) return "";
  const std::string iteration = FirstWord(*latest);
  std::string folder = iteration == "release" ? "release" : "";
  if (folder.empty() && !iteration.empty() && iteration.size() <= 7 &&
      iteration.find_first_not_of("0123456789") == std::string::npos) {
    folder = "iter_" + std::string(7 - iteration.size(), '0') + iteration;
  }
  const std::string at = path + "/" + folder;
  return !folder.empty() && IsDcpFolder(at) ? at : "";
}

Result<std::unique_ptr<SourceCheckpoint>> OpenDcpCheckpoint(const std::string& folder, const CommonOptions&) {
  return DcpSource::Open(folder);
}

}  // namespace reshard
