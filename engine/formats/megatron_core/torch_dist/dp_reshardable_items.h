// Megatron-Core 0.19's `dp_reshardable` optimizer layout (its training
// default) as DCP items of a torch_dist export.
//
// Each model-parallel rank's parameters fill one grad buffer per model chunk
// and param dtype, cut into buckets (formats/megatron_core/common/megatron_buckets.h has the layout and the
// facts). Each bucket of each Adam state is a flat fp32 tensor
//
//   [chained_{n}.]optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{j}.dtype_(
//       <param dtype>, torch.float32).bucket_idx_{k}.{param,exp_avg,exp_avg_sq}
//
// (`chained_0.` the dense parameters', `chained_1.` the experts', where
// Megatron-Core chains two optimizers: a model with experts at EP > 1)
// that DP rank r writes its share of, as Megatron does: one chunk per
// parameter piece and per alignment gap (zeros). Beside them the rank's
// bytes items `per_bucket_numel`, `per_bucket_numel_unpadded` and
// `optimizer` (the param groups), written by DP rank 0.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "container/dcp_writer.h"
#include "formats/megatron_core/common/megatron_buckets.h"
#include "pickle/dtype.h"
#include "pickle/value.h"
#include "reshard/status.h"
#include "util/byte_producer.h"

namespace reshard {

// One parameter of a model-parallel rank, as the rank holds it.
struct DpParam {
  std::string key;    // its torch_dist key, for messages
  DType dtype = DType::kFloat32;  // the parameter's: which grad buffer holds it
  int64_t numel = 0;  // of the rank's piece
  // A tied word embedding's copy on the first or last pipeline stage (PP > 1):
  // a bucket of its own (formats/megatron_core/common/megatron_buckets.h).
  bool shared_embedding = false;
  int chunk = 0;  // the model chunk (virtual pipeline stage) holding it
  // The piece's fp32 master, exp_avg and exp_avg_sq (kTorchDistStates),
  // fp32, flattened as the rank holds the piece.
  std::array<ByteProducer, 3> states;
  std::array<std::string, 3> from;  // where each comes from, for --dry-run
};

// The items of model-parallel rank `group` of one optimizer whose
// parameters, in registration order, are `params` (model chunk by model
// chunk: each chunk's grad buffers follow the previous chunk's), over
// `buckets.dp` DP ranks (the experts' optimizer: expert-data-parallel
// ranks), each grad buffer of chunk 0 cut into buckets of
// `buckets.bucket_size` (Megatron-LM builds the later chunks unbucketed):
// element d goes into (expert-)DP rank d's file. `param_groups` is the list of
// Megatron-Core param groups the rank's `optimizer` item holds.
Result<std::vector<std::vector<DcpWriteItem>>> DpReshardableItems(const MegatronDpGroup& group,
                                                                  const std::vector<DpParam>& params,
                                                                  const BucketOptions& buckets,
                                                                  const Value& param_groups);

}  // namespace reshard
