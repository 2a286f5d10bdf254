// The helpers of the seam that the formats share.
#include "formats/format.h"

#include <algorithm>

#include "util/strings.h"

namespace reshard {

std::string RankTensor::Label() const { return name + " (" + rule->Describe() + "): " + detail; }

int64_t FormatCount(const ExportOptions& options, const std::string& name) {
  int64_t n = 0;
  return ParseInt(FormatOption(options, name), &n) ? n : 0;
}

FormatOptionInfo FromOption(const std::string& fallback) {
  return {"from", FormatOptionInfo::Kind::kText, "Tensors from the fp32 masters or the weights", {"masters", "weights"},
          false, fallback};
}

FormatOptionInfo DTypeOption() {
  return {"dtype", FormatOptionInfo::Kind::kText, "Cast floating tensors (default: as stored)", {"fp32", "bf16", "fp16"}};
}

bool HoldsOptimizerState(const std::vector<FullTensor>& all) {
  return std::any_of(all.begin(), all.end(), [](const FullTensor& t) { return t.section == "optimizer"; });
}

bool HoldsFp32Masters(const std::vector<FullTensor>& all) {
  return std::any_of(all.begin(), all.end(), [](const FullTensor& t) { return t.state == kFp32Master; });
}

}  // namespace reshard
