#include "formats/megatron_core/common/nd_reformulation.h"

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

std::vector<int64_t> NdReformulation::saved_shape() const {
  std::vector<int64_t> shape = counts;
  shape.push_back(fragment_numel());
  return shape;
}

std::vector<int64_t> NdReformulation::FragmentIndex(const Box& box) const {
  std::vector<int64_t> index;
  for (size_t d = 0; d < counts.size(); ++d) index.push_back(box.offsets[d] / fragment[d]);
  return index;
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

Result<NdReformulation> NdReformulationOf(const std::vector<int64_t>& original, const std::vector<int64_t>& fragment,
                                          const std::string& fqn) {
  NdReformulation r;
  r.fragment = fragment;
  bool even = fragment.size() == original.size() && CheckedShapeNumel(original) >= 0;
  for (size_t d = 0; even && d < original.size(); ++d) {
    even = fragment[d] >= 1 && original[d] % fragment[d] == 0;
    if (even) r.counts.push_back(original[d] / fragment[d]);
  }
  if (!even) {
    return Status::InvalidInput(fqn + ": pieces of shape " + ShapeString(fragment) + " are no even cut of " +
                                ShapeString(original) + ", which Megatron-Core 0.14's fully_sharded_model_space needs");
  }
  return r;
}

}  // namespace reshard
