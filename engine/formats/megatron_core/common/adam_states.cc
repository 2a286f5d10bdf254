#include "formats/megatron_core/common/adam_states.h"

#include <vector>

#include "formats/megatron_core/common/megatron_buckets.h"
#include "formats/state_dict.h"

namespace reshard {

Status CheckFp32Masters(const std::vector<FullTensor>& all, const std::string& to) {
  if (!HoldsOptimizerState(all) || HoldsFp32Masters(all)) return Status::Ok();
  return Status::Unsupported("export --to " + to + ": the optimizer state holds no fp32 masters (the run's AdamW "
                             "stepped its parameters themselves), which Megatron's distributed optimizer keeps; "
                             "export with --weights-only");
}

Result<AdamStates> CutAdamStates(const SourceCheckpoint& src, const TpCut& cut, std::atomic<int64_t>* read) {
  AdamStates states;
  const char* source_states[] = {kFp32Master, "exp_avg", "exp_avg_sq"};
  std::vector<std::string> repeated_notes;  // the weights' cut said them already
  for (size_t s = 0; s < states.size(); ++s) {
    TpCut state_cut = cut;
    state_cut.state = source_states[s];
    RESHARD_ASSIGN_OR_RETURN(states[s], src.WeightsForTp(state_cut, &repeated_notes, read));
  }
  return states;
}

Result<Fp32Piece> Fp32StateOf(const AdamStates& states, int t, const std::string& name, size_t s) {
  for (const RankTensor& r : states[s].ranks[t]) {
    if (r.name != name) continue;
    return Fp32Piece{r.dtype == DType::kFloat32 ? r.produce : CastBytes(r.produce, r.dtype, DType::kFloat32),
                     r.Label()};
  }
  return Status::Internal("no optimizer " + std::string(kTorchDistStates[s]) + " of " + name);
}

}  // namespace reshard
