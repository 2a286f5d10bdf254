#include "formats/deepspeed/model/flat_group.h"

#include <algorithm>

#include "util/shape.h"

namespace reshard {

FlatGroup::FlatGroup(const std::vector<ParamShape>& params, int dp, int64_t alignment) : dp_(dp) {
  for (const auto& [name, shape] : params) {
    const int64_t n = ShapeNumel(shape);
    slots_.push_back({name, shape, numel_, n});
    numel_ += n;
  }
  padded_ = (numel_ + alignment - 1) / alignment * alignment;
}

int64_t FlatGroup::PaddingIn(int d) const {
  const int64_t begin = d * partition(), end = begin + partition();
  return std::max<int64_t>(0, end - std::max(begin, numel_));
}

std::vector<Fragment> FlatGroup::Fragments(int d) const {
  return FragmentsIn(d * partition(), (d + 1) * partition());
}

std::vector<Fragment> FlatGroup::FragmentsIn(int64_t begin, int64_t end) const {
  // The first slot ending after `begin`: slots are laid back to back.
  auto first = std::upper_bound(slots_.begin(), slots_.end(), begin,
                                [](int64_t at, const FlatSlot& s) { return at < s.offset + s.numel; });
  std::vector<Fragment> out;
  for (auto s = first; s != slots_.end() && s->offset < end; ++s) {
    const int64_t lo = std::max(begin, s->offset), hi = std::min(end, s->offset + s->numel);
    if (lo < hi) {
      out.push_back({static_cast<int>(s - slots_.begin()), lo - begin, lo - s->offset, hi - lo});
    }
  }
  return out;
}

}  // namespace reshard
