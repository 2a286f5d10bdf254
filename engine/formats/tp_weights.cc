#include "formats/tp_weights.h"

namespace reshard {

Result<TpWeights> CutWeights(const LogicalCheckpoint& ckpt, const TpCut& cut, bool has_state, const RankBytes& bytes,
                             std::vector<std::string>* notes) {
  RESHARD_RETURN_IF_ERROR(CheckValuesGiven(ckpt, cut.tp, cut.vocab_size));
  RESHARD_RETURN_IF_ERROR(ckpt.FirstError());
  if (!cut.state.empty() && !has_state) {
    return Status::InvalidInput(cut.state == kFp32Master
                                    ? "--from masters: the checkpoint has no optimizer state, so no fp32 masters; "
                                      "drop --from to export its weights"
                                    : "the checkpoint has no optimizer state; export with --weights-only");
  }
  TpWeights out;
  RESHARD_ASSIGN_OR_RETURN(out.padded_vocab, TargetPaddedVocab(ckpt, cut.tp, cut.vocab_size));
  std::string note = VocabPaddingNote(ckpt.vocab.padded_rows, out.padded_vocab, cut.tp, 0);
  if (!note.empty()) notes->push_back(std::move(note));
  for (const LogicalLayer& layer : ckpt.layers) {
    for (const LogicalTensor& t : layer.tensors) RESHARD_RETURN_IF_ERROR(CheckSplittable(t, cut.tp));
  }
  const TensorTarget target{cut.tp, out.padded_vocab, cut.replicated, 0};
  for (int rank = 0; rank < cut.tp; ++rank) {
    out.ranks.emplace_back();
    int block = -1;
    for (size_t li = 0; li < ckpt.layers.size(); ++li) {
      const LogicalLayer& layer = ckpt.layers[li];
      block += layer.role == "block" ? 1 : 0;
      for (size_t ti = 0; ti < layer.tensors.size(); ++ti) {
        const LogicalTensor& t = layer.tensors[ti];
        // A buffer has no optimizer state; its fp32 "master" is its weight.
        if (t.rule->buffer && !cut.state.empty() && cut.state != kFp32Master) continue;
        const std::string state = t.rule->buffer ? "" : cut.state;
        const TensorPlan plan = PlanTensor(ckpt, static_cast<int>(li), static_cast<int>(ti), rank, target);
        RankTensor r{t.rule, layer.role == "block" ? block : -1, t.key, t.name, ckpt.WeightDType(t), plan.shape,
                     DescribeSources(plan), nullptr};
        if (!state.empty()) {
          r.dtype = DType::kFloat32;
          r.detail += " (optimizer " + state + ")";
        }
        RESHARD_ASSIGN_OR_RETURN(r.produce, bytes(static_cast<int>(li), static_cast<int>(ti), plan, state));
        out.ranks.back().push_back(std::move(r));
      }
    }
  }
  return out;
}

}  // namespace reshard
