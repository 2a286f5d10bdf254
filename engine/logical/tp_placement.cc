#include "logical/tp_placement.h"

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

std::vector<Placement> PlacementsOf(const std::vector<Piece>& pieces,
                                    const std::vector<int64_t>& local_shape, int axis) {
  std::vector<Placement> out;
  for (const Piece& p : pieces) {
    Placement placement{Box::Slab(local_shape, axis, p.full_start, p.length),
                        std::vector<int64_t>(local_shape.size(), 0)};
    placement.local[axis] = p.local_start;
    out.push_back(std::move(placement));
  }
  return out;
}

TpPlacement PlaceTpRank(const ParamRule& rule, const std::vector<int64_t>& full, int tp, int rank) {
  TpPlacement out;
  out.shape = full;
  if (rule.policy == ParamRule::Policy::kReplicated) {
    out.placements = {Placement{Box::Whole(full), std::vector<int64_t>(full.size(), 0)}};
    return out;
  }
  const bool vocab = rule.policy == ParamRule::Policy::kVocab;
  const int axis = vocab ? 0 : rule.dim;
  out.shape[axis] /= tp;
  out.placements = PlacementsOf(RankPieces(full[axis], vocab ? 1 : rule.parts, tp, rank), out.shape, axis);
  return out;
}

}  // namespace reshard
