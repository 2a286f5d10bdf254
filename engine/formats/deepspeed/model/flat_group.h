// FlatGroup: the flat buffer DeepSpeed's optimizers build for one parameter
// group of one (pipeline, tensor) rank.
//
// Parameters are laid back to back in `param_shapes` order, one zero tail
// pads the buffer to a multiple of the alignment (2·DP for ZeRO-1/2 and the
// BF16 optimizer; none for FP16_Optimizer, which does not partition), and DP
// rank d owns the partition [d·P, (d+1)·P) with P = padded / DP. A parameter
// may span several partitions; the pieces are the "fragments" DeepSpeed
// records in param_slice_mappings.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "logical/optimizer_groups.h"

namespace reshard {

// ParamShape (logical/optimizer_groups.h): a parameter name and its (TP-local)
// shape, as `param_shapes` records it.

struct FlatSlot {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the group's flat buffer
  int64_t numel = 0;
};

// The part of one parameter inside one partition.
struct Fragment {
  int slot = 0;
  int64_t partition_start = 0;  // where it starts inside the partition
  int64_t param_offset = 0;     // where it starts inside the flattened parameter
  int64_t numel = 0;
};

class FlatGroup {
 public:
  FlatGroup(const std::vector<ParamShape>& params, int dp, int64_t alignment);

  const std::vector<FlatSlot>& slots() const { return slots_; }
  int64_t numel() const { return numel_; }          // parameter elements
  int64_t padded() const { return padded_; }        // with the alignment tail
  int64_t partition() const { return padded_ / dp_; }
  int dp() const { return dp_; }

  // Alignment elements inside rank `d`'s partition (at its end).
  int64_t PaddingIn(int d) const;
  // Fragments of the parameters inside rank `d`'s partition, in order.
  std::vector<Fragment> Fragments(int d) const;
  // Fragments of the parameters inside flat elements [begin, end), in order;
  // partition_start counts from `begin`.
  std::vector<Fragment> FragmentsIn(int64_t begin, int64_t end) const;

 private:
  std::vector<FlatSlot> slots_;
  int64_t numel_ = 0;
  int64_t padded_ = 0;
  int dp_ = 1;
};

}  // namespace reshard
