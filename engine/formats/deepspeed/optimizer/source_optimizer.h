// SourceOptimizer: where each parameter's optimizer state lies in a source
// checkpoint, whatever files hold it.
//
// Converting writes a target's optimizer state parameter by parameter: each
// state (the fp32 master, Adam's moments, ...) of each source parameter as
// the TP-local tensor a source TP rank holds, located in the source's bytes.
// DeepSpeed's optimizer shards are one source of it (ShardOptimizer,
// zero_shard_reader.h), a universal checkpoint's per-parameter files another
// (universal_reader.h); the planner and writers see only this interface.
#pragma once

#include <string>
#include <vector>

#include "logical/source_shard.h"
#include "pickle/value.h"
#include "reshard/status.h"

namespace reshard {

struct OptimizerFormat {
  // DeepSpeedZeroOptimizer (ZeRO-1/2): fp32 partitions stored without their
  // alignment padding, and each rank's own share of it in the paddings.
  // Otherwise BF16_Optimizer: padded fp32 partitions, the whole padding
  // recorded on the last DP rank.
  bool zero = false;
  std::string padding_key = "group_paddings";  // DeepSpeed 0.6.5: "groups_padding"
  bool slice_mappings = false;                 // param_slice_mappings present
  bool bf16_prefix = false;                    // bf16_zero_pp_rank_* file names
  // FP16_Optimizer without ZeRO: the whole state sits in each mp_rank file's
  // `optimizer`, one unpartitioned flat per group (fp32_groups_flat).
  bool embedded = false;
  // With `embedded`: a plain torch optimizer state_dict instead (fp32 without
  // ZeRO): per parameter, its per-element states shaped like it and scalar
  // states such as `step`, the parameters indexed across the groups in
  // order. There are no fp32 masters: the weights are fp32.
  bool per_parameter = false;

  // Elements the flat buffer of a group is padded to a multiple of.
  int64_t Alignment(int dp) const {
    // 2 fp16 elements per 4 bytes, times DP (DeepSpeed's nccl_start_alignment_factor).
    return embedded ? 1 : 2 * static_cast<int64_t>(dp);
  }
};

// The state name of the fp32 master weights (single_partition_of_fp32_groups).
inline constexpr const char* kMasterState = "fp32";

class SourceOptimizer {
 public:
  virtual ~SourceOptimizer() = default;

  // The on-disk format a conversion writes the target's state in.
  virtual const OptimizerFormat& format() const = 0;
  // kMasterState (absent in the per-parameter format), then the optimizer's
  // per-element states in file order.
  virtual const std::vector<std::string>& states() const = 0;
  bool HasMasters() const { return !states().empty() && states()[0] == kMasterState; }
  // The per-parameter format's scalar states (`step`): the same for every
  // parameter on every rank, carried as they are.
  virtual const std::vector<std::string>& scalar_states() const = 0;
  virtual int num_groups() const = 0;
  // Source TP ranks the states are located for (Locate's `t`).
  virtual int tp() const = 0;
  // The shard of pipeline stage 0, TP rank 0, DP rank 0 (for the embedded
  // formats: its `optimizer` dict): what targets are built from.
  virtual const Value& Template() const = 0;
  // Parameter names the source holds state for (each once; tied copies under their name).
  virtual std::vector<std::string> ParamNames() const = 0;
  virtual bool Has(const std::string& name) const = 0;
  // Where `state` of parameter `name` as TP rank `t` holds it lies: its
  // elements in order, as byte runs of the source files. Nothing is copied.
  virtual Result<SourceShard> Locate(const std::string& name, int t, const std::string& state) const = 0;
};

}  // namespace reshard
