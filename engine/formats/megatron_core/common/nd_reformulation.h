// Megatron-Core 0.14's nd-flattened reformulation, in which its
// `fully_sharded_model_space` layout saves the distributed optimizer's state
// (dcp-torch-dist-format.md §4).
//
// A state of a model tensor of global shape `original` is saved in pieces:
// the model tensor's fragments (its layers and its TP pieces: counts[d]
// equal fragments along each axis d, each `fragment` in shape), each
// flattened to its numel. The saved tensor has shape counts + [numel]: its
// row at fragment index (i_0, ..., i_n-1) holds that fragment, row-major,
// and the DP ranks' chunks cut its last axis. Read in row-major order, the
// saved tensor is then the fragments one after the other, fragment j (j
// counted row-major over `counts`) at elements [j * numel, (j + 1) * numel).
//
//   Result<NdReformulation> r = ReadNdReformulation({2, 2, 1, 256}, {2, 32, 16}, fqn);
//   r->FragmentBox(1);  // offsets {0, 16, 0}, sizes {1, 16, 16}: layer 0, TP rank 1
//
// The writer goes the other way: NdReformulationOf({2, 32, 16}, {1, 16, 16},
// fqn) gives the same counts, saved_shape() {2, 2, 1, 256}, and
// FragmentIndex(box) a fragment's row {0, 1, 0}.
//
// In the family's common floor: the torch_dist reader and writer
// (formats/megatron_core/torch_dist/) both need it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/status.h"
#include "util/box.h"

namespace reshard {

struct NdReformulation {
  std::vector<int64_t> counts;    // fragments along each axis of the original tensor
  std::vector<int64_t> fragment;  // each fragment's shape

  int64_t fragments() const;       // how many: the product of counts
  int64_t fragment_numel() const;  // the saved tensor's last dim
  // The box of the original tensor that fragment j (0 <= j < fragments())
  // is, counted row-major over counts.
  Box FragmentBox(int64_t j) const;
  // The saved tensor's shape: counts + [fragment_numel()].
  std::vector<int64_t> saved_shape() const;
  // The row of the saved tensor (an index on each axis of counts) holding
  // `box`. REQUIRES: `box` is a fragment (of the fragment's shape, at a
  // multiple of it).
  std::vector<int64_t> FragmentIndex(const Box& box) const;
};

// How a tensor saved with shape `saved` reformulates one of shape
// `original`. InvalidInput (one line naming `fqn`) when `saved` is not
// counts + [numel] of an even cut of `original`: a rank other than the
// original's plus one, a count that is not a positive divisor of its axis,
// or a last dim other than the fragments' numel.
Result<NdReformulation> ReadNdReformulation(const std::vector<int64_t>& saved, const std::vector<int64_t>& original,
                                            const std::string& fqn);

// How Megatron-Core 0.14 reformulates a tensor of shape `original` whose
// ranks hold pieces of shape `fragment`. InvalidInput (one line naming
// `fqn`) for a fragment of another rank than the original's or whose axes
// do not divide the original's.
Result<NdReformulation> NdReformulationOf(const std::vector<int64_t>& original, const std::vector<int64_t>& fragment,
                                          const std::string& fqn);

}  // namespace reshard
