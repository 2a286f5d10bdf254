// Megatron-Core's distributed optimizer state gathered onto DP rank 0: the
// object DistributedOptimizer.get_parameter_state_dp_zero makes per
// model-parallel rank, which Megatron-LM's `torch` format saves as
// `distrib_optim.pt` beside each model_optim_rng.pt (--use-distributed-
// optimizer) and Megatron-Core <= 0.14's `torch_dist` as the bytes item
// `optimizer.distributed.dp_group_idx_{i}.param_state` (`dp_zero_gather_scatter`):
//
//   {'buckets_coalesced': True,
//    <gbuf idx>: {(<param dtype>, <grad dtype>): {'param': fp32[N],
//        'exp_avg': fp32[N], 'exp_avg_sq': fp32[N], 'numel_unpadded': N}}, ...}
//
// one entry per grad buffer (megatron_buckets.h), each state one flat tensor:
// the buffer's buckets' unpadded ranges one after the other. The padding at
// each bucket's end (to a multiple of lcm(DP, 128)) is stripped and the
// 64-element alignment gaps between parameters are kept (zeros), so the
// gathered form does not depend on the DP size: a bucket starts at a multiple
// of 128, and a parameter's offset in its bucket is the same at any DP.
// Files older than `buckets_coalesced` (Megatron-LM before February 2024)
// kept per-bucket lists; they are refused.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "formats/megatron_core/common/megatron_buckets.h"
#include "pickle/dtype.h"
#include "pickle/value.h"
#include "reshard/status.h"
#include "util/byte_producer.h"

namespace reshard {

// The key Megatron-Core marks the coalesced form with.
inline constexpr char kBucketsCoalesced[] = "buckets_coalesced";

// One parameter of a model-parallel rank, as the rank holds it.
struct GatheredParam {
  std::string name;  // for messages
  DType dtype = DType::kFloat32;  // which grad buffer holds it
  int64_t numel = 0;              // of the rank's piece
  bool shared_embedding = false;  // a tied embedding's pipeline copy: a bucket of its own
  int chunk = 0;                  // the model chunk (virtual pipeline stage) holding it
};

// One grad buffer of a rank.
struct GradBuffer {
  int chunk = 0;
  DType param_dtype = DType::kFloat32;
  std::vector<size_t> params;    // indices into the list given, in registration order
  BucketLayout layout;           // slots in the order of `params`
  std::vector<int64_t> offsets;  // each parameter's first element in the gathered tensor
  int64_t numel_unpadded = 0;    // the gathered tensor's numel
};

// DDP's grad buffers of a rank whose parameters, in registration order, are
// `params` (model chunk by model chunk): one per model chunk and param dtype,
// chunk by chunk (each chunk is a DistributedDataParallel of its own), in
// the order each dtype first appears in the chunk, laid out by
// MegatronBucketLayout with `options`, whose bucket size Megatron-LM gives
// chunk 0 only. Errors as MegatronBucketLayout's.
Result<std::vector<GradBuffer>> MegatronGradBuffers(const std::vector<GatheredParam>& params,
                                                    const BucketOptions& options);

// One grad buffer's entry of a gathered object, as read.
struct GatheredBuffer {
  int gbuf = 0;
  DType param_dtype = DType::kFloat32, grad_dtype = DType::kFloat32;
  int64_t numel_unpadded = 0;
  std::array<const Tensor*, 3> states{};  // kTorchDistStates' order; into the Value read
};

// The buffers of a gathered object, in gbuf order. InvalidInput (naming
// `what`, ending with `fix`: how to do without the state) for anything but
// the coalesced form above with gbuf indices 0, 1, ..., one dtype pair
// each, and 1-D contiguous fp32 states of numel_unpadded elements;
// Unsupported for the form before buckets_coalesced.
Result<std::vector<GatheredBuffer>> ReadGatheredState(const Value& state, const std::string& what,
                                                      const std::string& fix);

// The gathered object of `buffers`, keyed by (param dtype,
// grad_dtype(param dtype)); each state's
// tensor made by `state_bytes(buffer, state)`, which gives the bytes of
// parameter `param` (an index into the list MegatronGradBuffers was given)
// of state `state` (kTorchDistStates' order), fp32.
using StateBytes = std::function<ByteProducer(size_t param, int state)>;
Value GatheredStateValue(const std::vector<GradBuffer>& buffers, const std::function<DType(DType)>& grad_dtype,
                         const StateBytes& state_bytes);

// The torch global naming `dtype` (torch.float32), as dtype pairs key the
// buffers, and back (nullopt for anything but a floating torch dtype).
Value TorchDTypeValue(DType dtype);
std::optional<DType> DTypeOfTorchGlobal(const Value& v);

}  // namespace reshard
