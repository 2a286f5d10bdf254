#include "formats/megatron_core/common/megatron_gathered.h"

#include <algorithm>
#include <memory>

namespace reshard {
namespace {

constexpr int kFp32Bytes = 4;

// A gathered state tensor: 1-D, contiguous, fp32, `numel` elements.
bool IsFlatState(const Value* v, int64_t numel) {
  if (v == nullptr || !v->is(Value::Kind::kTensor)) return false;
  const Tensor& t = v->as_tensor();
  return t.storage->dtype == DType::kFloat32 && t.sizes == std::vector<int64_t>{numel} && t.IsContiguous();
}

Result<GatheredBuffer> ReadBuffer(int gbuf, const Value& entry, const std::string& what, const std::string& fix) {
  const std::string where = what + "'s grad buffer " + std::to_string(gbuf);
  const Items* dtypes = DictItems(entry);
  if (dtypes == nullptr || dtypes->size() != 1 || !dtypes->front().first.is(Value::Kind::kTuple) ||
      dtypes->front().first.as_tuple().items.size() != 2) {
    return Status::InvalidInput(where + " is not one {(param dtype, grad dtype): states} entry" + fix);
  }
  const std::vector<Value>& pair = dtypes->front().first.as_tuple().items;
  const std::optional<DType> param_dtype = DTypeOfTorchGlobal(pair[0]), grad_dtype = DTypeOfTorchGlobal(pair[1]);
  const Value& states = dtypes->front().second;
  const Value* numel = Find(states, "numel_unpadded");
  if (!param_dtype || !grad_dtype || numel == nullptr || !numel->is(Value::Kind::kInt) || numel->as_int() < 1) {
    return Status::InvalidInput(where + " has no torch dtype pair or no numel_unpadded" + fix);
  }
  GatheredBuffer out{gbuf, *param_dtype, *grad_dtype, numel->as_int(), {}};
  for (size_t s = 0; s < out.states.size(); ++s) {
    const Value* t = Find(states, kTorchDistStates[s]);
    if (!IsFlatState(t, out.numel_unpadded)) {
      return Status::InvalidInput(where + "'s '" + kTorchDistStates[s] + "' is " +
                                  (t == nullptr ? std::string("missing") : t->DebugString(60)) +
                                  ", not a flat fp32 tensor of its numel_unpadded " +
                                  std::to_string(out.numel_unpadded) + fix);
    }
    out.states[s] = &t->as_tensor();
  }
  return out;
}

}  // namespace

std::optional<DType> DTypeOfTorchGlobal(const Value& v) {
  if (!v.is(Value::Kind::kGlobal) || v.as_global().module != "torch") return std::nullopt;
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    if (v.as_global().name == DTypeName(d)) return d;
  }
  return std::nullopt;
}

Value TorchDTypeValue(DType dtype) { return Value::MakeGlobal(Global{"torch", DTypeName(dtype)}); }

Result<std::vector<GradBuffer>> MegatronGradBuffers(const std::vector<GatheredParam>& params,
                                                    const BucketOptions& options) {
  std::vector<GradBuffer> buffers;
  for (size_t i = 0; i < params.size(); ++i) {
    const GatheredParam& p = params[i];
    auto it = std::find_if(buffers.begin(), buffers.end(),
                           [&p](const GradBuffer& b) { return b.chunk == p.chunk && b.param_dtype == p.dtype; });
    if (it == buffers.end()) it = buffers.insert(buffers.end(), GradBuffer{p.chunk, p.dtype, {}, {}, {}, 0});
    it->params.push_back(i);
  }
  for (GradBuffer& b : buffers) {
    std::vector<BucketParam> list;
    for (size_t i : b.params) list.push_back({params[i].name, params[i].numel, params[i].shared_embedding});
    BucketOptions chunk_options = options;
    if (b.chunk > 0) chunk_options.bucket_size.reset();
    RESHARD_ASSIGN_OR_RETURN(b.layout, MegatronBucketLayout(list, chunk_options));
    // The gathered tensor holds each bucket's unpadded range, one after the other.
    std::vector<int64_t> bucket_start;
    for (const Bucket& bucket : b.layout.buckets) {
      bucket_start.push_back(b.numel_unpadded);
      b.numel_unpadded += bucket.numel_unpadded;
    }
    for (const BucketSlot& slot : b.layout.slots) b.offsets.push_back(bucket_start[slot.bucket] + slot.offset);
  }
  return buffers;
}

Result<std::vector<GatheredBuffer>> ReadGatheredState(const Value& state, const std::string& what,
                                                      const std::string& fix) {
  const Items* items = DictItems(state);
  if (items == nullptr) return Status::InvalidInput(what + " is not a dict of grad buffers" + fix);
  const Value* coalesced = Find(state, kBucketsCoalesced);
  if (coalesced == nullptr || !coalesced->is(Value::Kind::kBool) || !coalesced->as_bool()) {
    return Status::Unsupported(what + " has no buckets_coalesced: True, so it is Megatron-LM's layout from before "
                               "February 2024 (per-bucket lists), which reshard does not read; load and save it once "
                               "with a current Megatron-LM (--ckpt-convert-update-legacy-dist-opt-format)" + fix);
  }
  std::vector<GatheredBuffer> out;
  for (const auto& [key, entry] : *items) {
    if (key.is(Value::Kind::kString) && key.as_string() == kBucketsCoalesced) continue;
    if (!key.is(Value::Kind::kInt) || key.as_int() != static_cast<int64_t>(out.size())) {
      return Status::InvalidInput(what + " holds the key " + key.DebugString(40) + " where grad buffer " +
                                  std::to_string(out.size()) + " belongs" + fix);
    }
    RESHARD_ASSIGN_OR_RETURN(GatheredBuffer buffer, ReadBuffer(static_cast<int>(out.size()), entry, what, fix));
    out.push_back(buffer);
  }
  if (out.empty()) return Status::InvalidInput(what + " holds no grad buffer" + fix);
  return out;
}

Value GatheredStateValue(const std::vector<GradBuffer>& buffers, const std::function<DType(DType)>& grad_dtype,
                         const StateBytes& state_bytes) {
  Value out = Value::MakeDict();
  Set(out, kBucketsCoalesced, Value::Bool(true));
  for (size_t b = 0; b < buffers.size(); ++b) {
    const GradBuffer& buffer = buffers[b];
    Value states = Value::MakeDict();
    for (int s = 0; s < static_cast<int>(std::size(kTorchDistStates)); ++s) {
      // Every parameter's state at its offset, zeros in the alignment gaps.
      std::vector<PlacedBytes> pieces;
      for (size_t j = 0; j < buffer.params.size(); ++j) {
        pieces.push_back({buffer.offsets[j] * kFp32Bytes, buffer.layout.slots[j].numel * kFp32Bytes,
                          state_bytes(buffer.params[j], s)});
      }
      Set(states, kTorchDistStates[s],
          MakeProducedTensor(DType::kFloat32, {buffer.numel_unpadded}, JoinedBytes(std::move(pieces))));
    }
    Set(states, "numel_unpadded", Value::Int(buffer.numel_unpadded));
    Items& items = *MutableDictItems(out);
    items.emplace_back(Value::Int(static_cast<int64_t>(b)),
                       Value::MakeDict({{Value::MakeTuple({TorchDTypeValue(buffer.param_dtype), TorchDTypeValue(grad_dtype(buffer.param_dtype))}),
                                         std::move(states)}}));
  }
  return out;
}

}  // namespace reshard
