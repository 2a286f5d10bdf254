#include "formats/consolidated/consolidated_source.h"

#include "formats/hf_common/hf_folder.h"
#include "plan/materialize.h"
#include "plan/slicing.h"
#include "util/human.h"
#include "util/strings.h"

namespace reshard {
namespace {

// Why no rule set describes the tensors, and how one would.
constexpr char kNoConfig[] =
    "it has no config.json; with the model's config.json beside the weights it is read as a Hugging Face model";

class WeightsSource : public SourceCheckpoint {
 public:
  explicit WeightsSource(HfFolder folder) : folder_(std::move(folder)) {
    info_.kind = "state dict";
    info_.tag_dir = folder_.dir;
    info_.files = folder_.files;
    info_.metadata = Value::MakeDict();
    info_.run_state.clear();
    info_.no_rules_reason = kNoConfig;
    info_.summary = Summary();
  }

  // The headers were read and checked when the folder was opened; what
  // convert would object to is that no rule set describes the tensors.
  void Lint(const LintOptions&, LintReport* report) const override {
    report->findings.push_back({Finding::Severity::kInfo,
                                "state dict: every tensor of the " + Count(static_cast<int64_t>(info_.files.size()),
                                                                           "weight file") +
                                    " read from its header and lying whole in its file"});
    report->findings.push_back({Finding::Severity::kError, NoRulesRefusal()});
  }

  std::string Describe() const override {
    std::string out = "tensors:\n";
    for (const std::string& name : folder_.order) {
      const Tensor& t = folder_.tensors.at(name).as_tensor();
      out += "  " + name + " " + DTypeName(t.storage->dtype) + ShapeString(t.sizes) + "\n";
    }
    return out;
  }

  Result<OutputPlan> Plan(const DeepSpeedPlanOptions&, std::vector<std::string>*) const override {
    return Status::Unsupported(NoRulesRefusal());
  }

  // Each tensor whole, under its key.
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy, std::atomic<int64_t>* read) const override {
    std::vector<FullTensor> out;
    for (const std::string& name : folder_.order) {
      const Tensor& t = folder_.tensors.at(name).as_tensor();
      SourceShard shard = SourceShard::Of(t, {});
      const Box all = Box::Whole(t.sizes);
      const std::vector<int64_t> origin(t.sizes.size(), 0);
      shard.placements = {Placement{all, origin}};
      TensorPlan whole;
      whole.shape = t.sizes;
      whole.cut_axis = -1;
      whole.copies = IntersectPlacements({Placement{all, origin}}, {shard}, all);
      out.push_back({"weights", name, name, "", "", t.storage->dtype, t.sizes, false,
                     RangeProducer(SourceTensor{t.storage->dtype, {std::move(shard)}}, std::move(whole), read)});
    }
    return out;
  }

 private:
  std::string NoRulesRefusal() const {
    return "convert writes a layout its model family's rules describe, and " + folder_.dir +
           " is a state dict read without a rule set" + info_.NoRulesWhy() +
           "; inspect, verify and export --to consolidated take it as it is";
  }

  std::string Summary() const {
    int64_t bytes = 0;
    for (const auto& [name, value] : folder_.tensors) {
      const Tensor& t = value.as_tensor();
      bytes += t.numel() * ElementSize(t.storage->dtype);
    }
    return "state dict without config.json; " + Count(static_cast<int64_t>(folder_.tensors.size()), "tensor") + " (" +
           HumanBytes(bytes) + ") in " + Count(static_cast<int64_t>(info_.files.size()), "file") + "; no rule set" +
           info_.NoRulesWhy();
  }

  const HfFolder folder_;
};

// Every tensor lies whole and contiguous in its file, as FullTensors takes it.
Status CheckContiguous(const HfFolder& folder) {
  for (const auto& [name, value] : folder.tensors) {
    const Tensor& t = value.as_tensor();
    const bool empty = t.storage != nullptr && t.numel() == 0;
    if (!empty && (t.storage == nullptr || t.storage->bytes.data == nullptr || !t.IsContiguous() ||
                   t.storage_offset < 0 || t.storage_offset + t.numel() > t.storage->numel)) {
      return Status::InvalidInput(folder.dir + "'s tensor " + name + " is not stored contiguous inside its storage, "
                                  "as a state dict's weights are; save it with .contiguous()");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SourceCheckpoint>> OpenWeightsWithoutConfig(const std::string& dir) {
  RESHARD_ASSIGN_OR_RETURN(HfFolder folder, ReadWeightsWithoutConfig(dir));
  RESHARD_RETURN_IF_ERROR(CheckContiguous(folder));
  return std::unique_ptr<SourceCheckpoint>(std::make_unique<WeightsSource>(std::move(folder)));
}

}  // namespace reshard
