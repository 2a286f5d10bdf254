#include "formats/dcp/dcp_source.h"

#include <sys/stat.h>

#include "container/regular_file.h"
#include "formats/dcp_common/dcp_content.h"
#include "formats/dcp_common/megatron_tracker.h"
#include "plan/materialize.h"
#include "plan/slicing.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

// A `.metadata` entry of any kind makes the folder a DCP folder: one that is
// not a regular file (a FIFO, a link to a device, a folder) is refused by
// name when it is read, never taken for another format's folder.
bool IsDcpFolder(const std::string& path) {
  struct stat st;
  return ::lstat((path + "/" + kDcpMetadataFile).c_str(), &st) == 0;
}

class DcpSource : public SourceCheckpoint {
 public:
  DcpSource(DcpContent content, std::string why_no_rules) : c_(std::move(content)) {
    SetInfo();
    SetReason(std::move(why_no_rules));
  }

  // The chunks were read and checked when the checkpoint was opened; what
  // convert would object to is that no rule set describes the tensors.
  void Lint(const LintOptions&, LintReport* report) const override {
    report->findings.push_back({Finding::Severity::kInfo,
                                "DCP: every chunk of the " + Count(static_cast<int64_t>(c_.tensors.size()), "tensor") +
                                    " read from its .distcp window and placed in its tensor, which the chunks tile"});
    if (!info_.no_rules_reason.empty()) report->findings.push_back({Finding::Severity::kInfo, info_.no_rules_reason});
    report->findings.push_back({Finding::Severity::kError, NoRulesRefusal()});
  }

  std::string Describe() const override {
    std::string out = "tensors (global shapes; chunks as offsets + sizes):\n";
    for (const DcpTensor& t : c_.tensors) {
      out += "  " + t.fqn + " " + DTypeName(t.dtype) + ShapeString(t.size) + ", " +
             Count(static_cast<int64_t>(t.shards.size()), "chunk") + ":";
      for (const SourceShard& s : t.shards) {
        out += " " + ShapeString(s.placements[0].global.offsets) + "+" + ShapeString(s.shape);
      }
      out += "\n";
    }
    if (c_.bytes_items.empty()) return out;
    out += "bytes items (pickled objects):\n";
    for (const std::string& fqn : c_.bytes_items) out += "  " + fqn + "\n";
    return out;
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions&, std::vector<std::string>*) const override {
    return Status::Unsupported(NoRulesRefusal());
  }

  // Each tensor whole, under its key.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy, std::atomic<int64_t>* read) const override {
    std::vector<FullTensor> out;
    for (const DcpTensor& t : c_.tensors) {
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
  std::string NoRulesRefusal() const {
    return "convert writes a layout its model family's rules describe, and " + c_.folder +
           " is a Distributed Checkpoint read without a rule set" + info_.NoRulesWhy() + "; export --to consolidated writes its "
           "tensors whole";
  }

  void SetInfo() {
    info_.kind = "DCP";
    info_.tag_dir = c_.folder;
    info_.files = c_.Paths();
    info_.iteration = IterationOfFolder(c_.folder);
    info_.summary = Summary();
  }

  void SetReason(std::string why) {
    info_.no_rules_reason = std::move(why);
    info_.summary += info_.NoRulesWhy();
  }

  std::string Summary() const {
    int64_t chunks = 0, bytes = 0;
    for (const DcpTensor& t : c_.tensors) {
      chunks += static_cast<int64_t>(t.shards.size());
      bytes += Box::Whole(t.size).numel() * ElementSize(t.dtype);
    }
    std::string s =
        c_.torch_dist ? "Megatron-Core torch_dist checkpoint" : "PyTorch Distributed Checkpoint";
    if (info_.iteration > 0) s += "; iteration " + std::to_string(info_.iteration);
    return s + "; " + Count(static_cast<int64_t>(c_.tensors.size()), "tensor") + " in " + Count(chunks, "chunk") +
           " (" + HumanBytes(bytes) + "), " + Count(static_cast<int64_t>(c_.bytes_items.size()), "bytes item") +
           ", " + Count(static_cast<int64_t>(c_.files.size()), ".distcp file") + "; no rule set";
  }

  const DcpContent c_;
};

}  // namespace

std::string DcpCheckpointFolder(const std::string& path) {
  if (IsDcpFolder(path)) return path;
  // Megatron-LM's root: its tracker names the folder (OpenCheckpoint refuses a bad one).
  const Result<std::string> folder = MegatronTrackedFolder(path);
  if (!folder.ok() || folder->empty()) return "";
  const std::string at = path + "/" + *folder;
  return IsDcpFolder(at) ? at : "";
}

std::unique_ptr<SourceCheckpoint> OpenDcpCheckpoint(DcpContent content, std::string why_no_rules) {
  return std::make_unique<DcpSource>(std::move(content), std::move(why_no_rules));
}

}  // namespace reshard
