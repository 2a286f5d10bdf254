#include "formats/megatron_core/torch_dist/dp_reshardable_items.h"

#include <algorithm>
#include <memory>

namespace reshard {
namespace {

constexpr int kFp32Bytes = 4;

// The bytes of bucket `bucket`'s tensor of state `state`: each parameter's
// piece at its slot, zeros in the alignment gaps. Each DP chunk's item holds
// a copy of the producer, which shares the pieces.
ByteProducer BucketBytes(const BucketLayout& layout, int bucket, const std::vector<const DpParam*>& params,
                         int state) {
  std::vector<PlacedBytes> pieces;
  for (size_t i = 0; i < params.size(); ++i) {
    const BucketSlot& slot = layout.slots[i];
    if (slot.bucket == bucket) {
      pieces.push_back({slot.offset * kFp32Bytes, slot.numel * kFp32Bytes, params[i]->states[state]});
    }
  }
  return JoinedBytes(std::move(pieces));
}

// Where the chunk [offset, offset + size) of bucket `bucket`'s tensor of
// state `state` comes from, for --dry-run: the parameter piece it lies in
// (MegatronBucketChunks cuts at every piece's bounds), else alignment zeros.
std::string ChunkFrom(const BucketLayout& layout, int bucket, const std::vector<const DpParam*>& params, int state,
                      int64_t offset, int64_t size) {
  for (size_t i = 0; i < params.size(); ++i) {
    const BucketSlot& slot = layout.slots[i];
    if (slot.bucket != bucket || offset < slot.offset || offset >= slot.offset + slot.numel) continue;
    const int64_t first = offset - slot.offset;
    return params[i]->from[state] + ", elements [" + std::to_string(first) + "," + std::to_string(first + size) + ")";
  }
  return "zeros (bucket alignment)";
}

// `{(param dtype, torch.float32): [numel per bucket]}`, one grad buffer's
// entry of per_bucket_numel(_unpadded).
Value BufferNumels(DType dtype, const std::vector<Value>& numels) {
  auto torch_dtype = [](DType d) { return Value::MakeGlobal(Global{"torch", DTypeName(d)}); };
  return Value::MakeDict({{Value::MakeTuple({torch_dtype(dtype), torch_dtype(DType::kFloat32)}),
                           Value::MakeList(numels)}});
}

}  // namespace

Result<std::vector<std::vector<DcpWriteItem>>> DpReshardableItems(const MegatronDpGroup& group,
                                                                  const std::vector<DpParam>& params,
                                                                  const BucketOptions& buckets,
                                                                  const Value& param_groups) {
  const int dp = buckets.dp;
  // DDP's grad buffers: one per model chunk and param dtype, chunk by chunk,
  // in the order each dtype first appears in its chunk.
  std::vector<std::pair<int, DType>> owners;  // (chunk, dtype) of each buffer
  std::vector<std::vector<const DpParam*>> buffers;
  for (const DpParam& p : params) {
    const std::pair<int, DType> owner{p.chunk, p.dtype};
    const size_t b = std::find(owners.begin(), owners.end(), owner) - owners.begin();
    if (b == owners.size()) {
      owners.push_back(owner);
      buffers.emplace_back();
    }
    buffers[b].push_back(&p);
  }
  std::vector<DType> dtypes;
  for (const auto& owner : owners) dtypes.push_back(owner.second);
  std::vector<std::vector<DcpWriteItem>> items(dp);
  std::vector<Value> numels, unpadded;
  for (size_t b = 0; b < buffers.size(); ++b) {
    std::vector<BucketParam> list;
    for (const DpParam* p : buffers[b]) list.push_back({p->key, p->numel, p->shared_embedding});
    BucketOptions options = buckets;
    if (owners[b].first > 0) options.bucket_size.reset();
    RESHARD_ASSIGN_OR_RETURN(BucketLayout layout, MegatronBucketLayout(list, options));
    std::vector<Value> numel, numel_unpadded;
    for (size_t k = 0; k < layout.buckets.size(); ++k) {
      const Bucket& bucket = layout.buckets[k];
      numel.push_back(Value::Int(bucket.numel));
      numel_unpadded.push_back(Value::Int(bucket.numel_unpadded));
      const int64_t share = bucket.numel / dp;
      for (int s = 0; s < 3; ++s) {
        const std::string key = MegatronBucketKey(group, static_cast<int>(b), dtypes[b], DType::kFloat32,
                                                  static_cast<int>(k), kTorchDistStates[s]);
        const ByteProducer flat = BucketBytes(layout, static_cast<int>(k), buffers[b], s);
        for (const auto& [offset, size] : MegatronBucketChunks(layout, static_cast<int>(k), dp)) {
          DcpWriteItem item = DcpTensorItem(key, DType::kFloat32, {bucket.numel_unpadded}, Box{{offset}, {size}},
                                            BytesFrom(flat, offset * kFp32Bytes));
          item.from = ChunkFrom(layout, static_cast<int>(k), buffers[b], s, offset, size);
          items[offset / share].push_back(std::move(item));
        }
      }
    }
    numels.push_back(BufferNumels(dtypes[b], numel));
    unpadded.push_back(BufferNumels(dtypes[b], numel_unpadded));
  }
  // Megatron-Core wraps each object it saves in a list.
  items[0].push_back(DcpBytesItem(group.ItemKey("per_bucket_numel"), Value::MakeList({Value::MakeList(numels)})));
  items[0].push_back(
      DcpBytesItem(group.ItemKey("per_bucket_numel_unpadded"), Value::MakeList({Value::MakeList(unpadded)})));
  items[0].push_back(DcpBytesItem(
      group.ItemKey("optimizer"),
      Value::MakeList({Value::MakeDict({{Value::String("param_groups"), param_groups}})})));
  return items;
}

}  // namespace reshard
