#include "plan/slicing.h"

#include <algorithm>

namespace reshard {

std::vector<Piece> RankPieces(int64_t full, int parts, int tp, int rank) {
  const int64_t part = full / parts;
  const int64_t per_rank = part / tp;
  std::vector<Piece> pieces;
  for (int p = 0; p < parts; ++p) {
    pieces.push_back({p * part + rank * per_rank, p * per_rank, per_rank});
  }
  return pieces;
}

std::vector<SliceCopy> IntersectPieces(const std::vector<Piece>& target,
                                       const std::vector<std::vector<Piece>>& source_by_rank,
                                       int dim, int64_t available) {
  std::vector<SliceCopy> copies;
  for (const Piece& t : target) {
    const int64_t t_end = std::min(t.full_start + t.length, available);
    for (size_t rank = 0; rank < source_by_rank.size(); ++rank) {
      for (const Piece& s : source_by_rank[rank]) {
        const int64_t lo = std::max(t.full_start, s.full_start);
        const int64_t hi = std::min(t_end, s.full_start + s.length);
        if (lo >= hi) continue;
        copies.push_back({static_cast<int>(rank), dim, s.local_start + (lo - s.full_start),
                          t.local_start + (lo - t.full_start), hi - lo});
      }
    }
  }
  // Target order makes the writes sequential.
  std::sort(copies.begin(), copies.end(),
            [](const SliceCopy& a, const SliceCopy& b) { return a.dst_start < b.dst_start; });
  return copies;
}

std::vector<SliceFill> FillsBeyond(const std::vector<Piece>& target, int dim, int64_t available,
                                   double value) {
  std::vector<SliceFill> fills;
  for (const Piece& t : target) {
    const int64_t lo = std::max(t.full_start, available);
    const int64_t hi = t.full_start + t.length;
    if (lo < hi) fills.push_back({dim, t.local_start + (lo - t.full_start), hi - lo, value});
  }
  return fills;
}

}  // namespace reshard
