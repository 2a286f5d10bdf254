// A source's Adam state as Megatron-Core's distributed optimizer holds it:
// the fp32 masters, exp_avg and exp_avg_sq (kTorchDistStates' order), each
// cut for a target TP exactly as the weights are, and one rank's piece of
// one of them as fp32 bytes. What the torch_dist and the Megatron-LM torch
// writers both lay out, each in its own files.
#pragma once

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "formats/format.h"

namespace reshard {

using AdamStates = std::array<TpWeights, 3>;

// Refuses optimizer states (FullTensors' "optimizer" section of `all`)
// without fp32 masters, which Megatron's optimizer keeps: a bf16 run's torch
// AdamW steps its parameters themselves. `to` names the target.
Status CheckFp32Masters(const std::vector<FullTensor>& all, const std::string& to);

// The source's three states cut like `cut` (whose `state` is ignored).
Result<AdamStates> CutAdamStates(const SourceCheckpoint& src, const TpCut& cut, std::atomic<int64_t>* read);

// TP rank `t`'s piece of state `s` (of CutAdamStates) of the weight `name`:
// its bytes as fp32, and where they come from (for --dry-run).
struct Fp32Piece {
  ByteProducer bytes;
  std::string from;
};
Result<Fp32Piece> Fp32StateOf(const AdamStates& states, int t, const std::string& name, size_t s);

}  // namespace reshard
