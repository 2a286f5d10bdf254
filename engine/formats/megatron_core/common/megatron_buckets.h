// Where Megatron-Core's distributed optimizer keeps each parameter's state
// in its `dp_reshardable` checkpoints (Megatron-Core 0.19's default layout).
//
// Megatron's DistributedDataParallel puts the parameters of one model chunk
// into one contiguous grad buffer per (param dtype, grad dtype) — expert-
// parallel parameters into buffers of their own — cut into buckets. The
// optimizer's fp32 master (`param`), `exp_avg` and `exp_avg_sq` follow the
// same flat layout, and `dp_reshardable` writes each bucket of each as one
// 1-D tensor
//
//   optimizer.distributed.dp_group_idx_{i}.gbuf_idx_{j}.dtype_(<param dtype>,
//       <grad dtype>).bucket_idx_{k}.{param,exp_avg,exp_avg_sq}
//
// of the bucket's unpadded numel, beside the bytes items `per_bucket_numel`
// and `per_bucket_numel_unpadded`. The layout (docs/megatron-core-optimizer.md
// has the facts and how they were proved against real saves):
//   - parameters in reverse registration order (the order of
//     `named_parameters()`, reversed: backprop order);
//   - each parameter's start rounded up to a multiple of 64 elements;
//   - a bucket closes after the parameter that makes it reach `bucket_size`
//     elements, and a shared embedding (the tied output layer's copy on the
//     last pipeline stage) is always a bucket of its own;
//   - a bucket's unpadded numel runs from its start to its last parameter's
//     end (64-alignment gaps included), its padded numel rounds that up to
//     lcm(DP, 128) (lcm(DP, 128, 65536) with pad_buckets_for_high_nccl_busbw),
//     and the next bucket starts there.
//
//   Result<BucketLayout> layout = MegatronBucketLayout(params, {.dp = 8});
//   RESHARD_RETURN_IF_ERROR(CheckBucketNumels(*layout, numel, unpadded, key));
//
// Pure functions: no file is read here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pickle/dtype.h"
#include "reshard/status.h"

namespace reshard {

// Megatron-Core's names of Adam's states, the fp32 master first.
inline constexpr const char* kTorchDistStates[] = {"param", "exp_avg", "exp_avg_sq"};

// Megatron-Core's constants (0.19, megatron/core/optimizer/param_layout.py).
constexpr int64_t kMegatronParamAlignment = 64;         // each parameter's start
constexpr int64_t kMegatronBucketAlignment = 128;       // each bucket's end, with DP
constexpr int64_t kMegatronHighBusBwAlignment = 65536;  // pad_buckets_for_high_nccl_busbw

// The bucket size Megatron-LM uses with --overlap-grad-reduce and no
// --ddp-bucket-size: max(40M, 1M · DP) elements. Without overlap (the
// default), and on every pipeline stage but the first, there is one bucket
// (Megatron-Core's DistributedDataParallel sets no bucket size there).
int64_t MegatronDefaultBucketSize(int dp);

// One parameter of a grad buffer, as the model registers it.
struct BucketParam {
  std::string name;
  int64_t numel = 0;              // TP-local
  bool shared_embedding = false;  // Megatron's `shared_embedding` attribute
};

struct BucketOptions {
  // The size of the group the buffer is sharded over: DP × CP for dense
  // parameters, the expert DP size for expert-parallel ones.
  int dp = 1;
  // nullopt: no size limit (one bucket unless a shared embedding splits it).
  std::optional<int64_t> bucket_size;
  bool pad_for_high_nccl_busbw = false;
};

struct Bucket {
  int64_t start = 0;           // in the whole grad buffer
  int64_t numel = 0;           // padded: what `per_bucket_numel` records
  int64_t numel_unpadded = 0;  // the checkpoint tensor's size
};

// Where one parameter lies.
struct BucketSlot {
  int bucket = 0;
  int64_t offset = 0;  // in its bucket's tensor
  int64_t numel = 0;
};

struct BucketLayout {
  std::vector<Bucket> buckets;
  std::vector<BucketSlot> slots;  // one per parameter, in the order given
};

// The layout of a grad buffer whose parameters, in registration order, are
// `params`. InvalidInput for no parameters, a numel < 1, DP < 1 or a
// bucket size < 1.
Result<BucketLayout> MegatronBucketLayout(const std::vector<BucketParam>& params,
                                          const BucketOptions& options);

// Whether a checkpoint's `per_bucket_numel` / `per_bucket_numel_unpadded` of
// one buffer (`what` names it in messages) are the layout's. InvalidInput
// naming the first difference: a reader must refuse a layout it would
// misread.
Status CheckBucketNumels(const BucketLayout& layout, const std::vector<int64_t>& per_bucket_numel,
                         const std::vector<int64_t>& per_bucket_numel_unpadded,
                         const std::string& what);

// The layout of a grad buffer as a checkpoint records it in
// `per_bucket_numel` / `per_bucket_numel_unpadded`: Megatron's layout of
// `params` with no bucket size, or with a bucket size that cuts the
// recorded buckets. The bucket size (--ddp-bucket-size) is not recorded,
// but the buckets show one: the smallest bucket that closed by size is
// such a size (every parameter end before a close is below it), so the
// recorded unpadded numels are the sizes tried. `options.bucket_size` is
// ignored. InvalidInput (CheckBucketNumels' message) when no size fits.
Result<BucketLayout> MegatronRecordedLayout(const std::vector<BucketParam>& params, BucketOptions options,
                                            const std::vector<int64_t>& per_bucket_numel,
                                            const std::vector<int64_t>& per_bucket_numel_unpadded,
                                            const std::string& what);

// The 1-D chunks (offset, size) Megatron writes of bucket `bucket`'s tensor,
// in order: DP rank r owns [r·S, (r+1)·S) of the padded bucket (S = numel /
// DP) and writes each parameter piece and each padding gap of it as a chunk
// of its own, up to the unpadded end. They tile [0, numel_unpadded).
// REQUIRES: `layout` was made with `dp`, bucket < layout.buckets.size().
std::vector<std::pair<int64_t, int64_t>> MegatronBucketChunks(const BucketLayout& layout,
                                                              int bucket, int dp);

// One model-parallel rank's items of one of Megatron-Core's distributed
// optimizers. `dp_group_idx` is the rank in the optimizer's model-parallel
// group: MegatronDpGroupIdx for dense parameters, MegatronExpertDpGroupIdx
// for the experts'. When Megatron-Core chains more than one optimizer (a
// model with experts at EP > 1: 0 the dense parameters', 1 the experts'),
// each key starts `chained_{n}.`.
struct MegatronDpGroup {
  int dp_group_idx = 0;
  int chained = -1;  // -1: one optimizer, no prefix

  // `[chained_{n}.]optimizer.distributed.dp_group_idx_{i}`: what each key
  // of the rank's items starts with.
  std::string Prefix() const;
  // The key of the rank's bytes item `name` (per_bucket_numel, optimizer, ...).
  std::string ItemKey(const std::string& name) const;
};

// The checkpoint key of one state of one bucket, e.g. `optimizer.distributed.
// dp_group_idx_0.gbuf_idx_1.dtype_(torch.float32, torch.float32).bucket_idx_0.
// exp_avg`.
std::string MegatronBucketKey(const MegatronDpGroup& group, int gbuf_idx, DType param_dtype, DType grad_dtype,
                              int bucket, const std::string& state);

// One parameter a pipeline stage registers: a key, its layer when the key
// is one per layer (-1 otherwise), and its expert when the key is one per
// expert (-1 otherwise).
struct RegisteredParam {
  std::string key;
  int64_t layer = -1;
  int64_t expert = -1;
};

// The parameters of a stage in registration order, from `order` (a rule
// set's torch_dist.optimizer_order: a key of every parameter the family can
// have, a layer's keys once): the keys before the layer keys on the first
// stage, the layer keys for each of the stage's layers [first_layer,
// first_layer + layers), the keys after them on the last stage. `tied_head`
// (empty for none) is the last stage's copy of a tied word embedding at
// PP > 1, which Megatron-Core registers last unless `order` places it. A key
// of `order` the model lacks is the caller's to skip.
std::vector<RegisteredParam> StageRegistrationOrder(const std::vector<std::string>& order,
                                                    const std::function<bool(const std::string&)>& is_layer_key,
                                                    int64_t first_layer, int64_t layers, bool first_stage,
                                                    bool last_stage, const std::string& tied_head = "");

// Which parameters of a model-parallel rank one of Megatron-Core's
// optimizers holds. At EP 1 one optimizer holds them all, the experts as
// dense parameters; at EP > 1 a ChainedOptimizer holds the dense
// parameters' and the experts', the latter an EP rank's experts only.
struct OptimizerShare {
  bool dense = true;  // the parameters of no expert
  int64_t first_expert = 0;  // the experts held: [first_expert, first_expert + experts)
  int64_t experts = 0;
};

// `stage` (StageRegistrationOrder's, each expert key once per layer) as the
// optimizer of `share` holds it: each layer's run of expert keys
// (`is_expert_key`) once for each expert held, in order, as SequentialMLP
// registers its local experts one after the other; the other keys where
// share.dense says.
std::vector<RegisteredParam> SharedRegistrationOrder(const std::vector<RegisteredParam>& stage,
                                                     const std::function<bool(const std::string&)>& is_expert_key,
                                                     const OptimizerShare& share);

// The model-parallel rank of (TP rank, PP rank) in Megatron's default rank
// order (TP fastest, then PP): tp_rank + TP · pp_rank.
int MegatronDpGroupIdx(int tp_rank, int pp_rank, int tp);

// The rank in the experts' model-parallel group (expert TP × EP × PP, as
// Megatron-Core orders its expert ranks: expert TP fastest, then EP, then
// PP) of (expert TP rank, EP rank, PP rank).
int MegatronExpertDpGroupIdx(int etp_rank, int ep_rank, int pp_rank, int etp, int ep);

}  // namespace reshard
