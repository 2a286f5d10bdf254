#include "formats/deepspeed/optimizer/zero_shard_lint.h"

#include "util/strings.h"

namespace reshard {

Finding OptimizerFinding(const SourceOptimizer& opt, size_t shard_files) {
  const OptimizerFormat& f = opt.format();
  const std::string states = Join(opt.states(), ", ");
  if (f.per_parameter) {
    const std::string scalars =
        opt.scalar_states().empty() ? "" : "; scalar states " + Join(opt.scalar_states(), ", ");
    return {Finding::Severity::kInfo,
            "optimizer: torch optimizer state in the mp_rank files (" +
                std::to_string(opt.num_groups()) + " groups, per-parameter states " +
                (states.empty() ? "none" : states) + scalars +
                "); its parameters agree with DeepSpeed's stage partition"};
  }
  const std::string where = f.embedded ? std::string("FP16_Optimizer state in the mp_rank files (")
                                       : std::to_string(shard_files) + " shards (" +
                                             (f.zero ? "ZeRO-1/2" : "BF16 optimizer") + ", ";
  return {Finding::Severity::kInfo,
          "optimizer: " + where + std::to_string(opt.num_groups()) + " groups, states " + states +
              (f.slice_mappings || f.embedded ? "" : ", no param_slice_mappings") + "); " +
              (f.embedded ? "its groups agree with DeepSpeed's stage partition"
                          : "their layout agrees with param_shapes")};
}

std::string WeightsOnlyNote(const std::string& what) {
  return "weights only: the " + what + " were not converted. Resume with --no-load-optim "
         "(bigscience Megatron-DeepSpeed; fp32 masters are rebuilt from the weights) or, on "
         "microsoft Megatron-DeepSpeed, which always loads optimizer state, with --finetune";
}

}  // namespace reshard
