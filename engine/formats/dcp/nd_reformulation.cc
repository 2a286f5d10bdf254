#include "formats/dcp/nd_reformulation.h"

#include "util/human.h"
#include "util/shape.h"

namespace reshard {

int64_t NdReformulation::fragments() const { return ShapeNumel(counts); }

int64_t NdReformulation::fragment_numel() const { return ShapeNumel(fragment); }

Box NdReformulation::FragmentBox(int64_t j) const {
  Box box{std::vector<int64_t>(counts.size(), 0), fragment};
  for (size_t d = counts.size(); d-- > 0;) {  // the last axis counts fastest
    box.offsets[d] = (j % counts[d]) * fragment[d];
    j /= counts[d];
  }
  return box;
}

Result<NdReformulation> ReadNdReformulation(const std::vector<int64_t>& saved, const std::vector<int64_t>& original,
                                            const std::string& fqn) {
  const Status bad = Status::InvalidInput(
      fqn + " has the shape " + ShapeString(saved) + ", which is no reformulation of its original shape " + ShapeString(original) +
      " (fragments per axis, then their numel); the checkpoint's .metadata does not fit its tensors");
  if (saved.size() != original.size() + 1 || CheckedShapeNumel(saved) < 0 || CheckedShapeNumel(original) < 0) {
    return bad;
  }
  NdReformulation r;
  r.counts.assign(saved.begin(), saved.end() - 1);
  for (size_t d = 0; d < original.size(); ++d) {
    if (r.counts[d] < 1 || original[d] % r.counts[d] != 0) return bad;
    r.fragment.push_back(original[d] / r.counts[d]);
  }
  if (saved.back() != r.fragment_numel()) return bad;
  return r;
}

}  // namespace reshard
