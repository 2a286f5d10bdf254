#include "formats/megatron_core/common/megatron_buckets.h"

#include <algorithm>
#include <numeric>

namespace reshard {
namespace {

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

Status CheckInput(const std::vector<BucketParam>& params, const BucketOptions& options) {
  if (params.empty()) return Status::InvalidInput("a grad buffer with no parameters");
  if (options.dp < 1) return Status::InvalidInput("DP size " + std::to_string(options.dp) + " < 1");
  if (options.bucket_size && *options.bucket_size < 1) {
    return Status::InvalidInput("bucket size " + std::to_string(*options.bucket_size) + " < 1");
  }
  for (const BucketParam& p : params) {
    if (p.numel < 1) return Status::InvalidInput("parameter " + p.name + " has no elements");
  }
  return Status::Ok();
}

// Lays parameters out one at a time, as Megatron's distributed optimizer
// does, closing buckets as it goes.
class LayoutBuilder {
 public:
  LayoutBuilder(size_t n, int64_t end_alignment) : end_alignment_(end_alignment) {
    layout_.slots.resize(n);
  }

  void Place(size_t index, const BucketParam& p, std::optional<int64_t> bucket_size) {
    int64_t start = RoundUp(cursor_, kMegatronParamAlignment);
    // A shared embedding's gradient is all-reduced with the other pipeline
    // end's copy, so it never shares a bucket; the bucket before it ends at
    // its aligned start.
    if (p.shared_embedding && open_) {
      Close(start);
      start = cursor_;
    }
    const int64_t end = start + p.numel;
    layout_.slots[index] =
        BucketSlot{static_cast<int>(layout_.buckets.size()), start - bucket_start_, p.numel};
    open_ = true;
    cursor_ = end;
    if ((bucket_size && end - bucket_start_ >= *bucket_size) || p.shared_embedding) Close(end);
  }

  BucketLayout Finish() {
    if (open_) Close(cursor_);
    return std::move(layout_);
  }

 private:
  // Ends the open bucket at `end` and pads it so that every DP rank owns an
  // equal, aligned shard of it; the next bucket starts after the padding.
  void Close(int64_t end) {
    const int64_t padded_end = RoundUp(end, end_alignment_);
    layout_.buckets.push_back(
        Bucket{bucket_start_, padded_end - bucket_start_, end - bucket_start_});
    bucket_start_ = cursor_ = padded_end;
    open_ = false;
  }

  int64_t end_alignment_;
  BucketLayout layout_;
  int64_t bucket_start_ = 0;
  int64_t cursor_ = 0;
  bool open_ = false;
};

std::string Numels(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

int64_t MegatronDefaultBucketSize(int dp) { return std::max<int64_t>(40000000, 1000000LL * dp); }

Result<BucketLayout> MegatronBucketLayout(const std::vector<BucketParam>& params,
                                          const BucketOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckInput(params, options));
  int64_t end_alignment = std::lcm<int64_t>(options.dp, kMegatronBucketAlignment);
  if (options.pad_for_high_nccl_busbw) {
    end_alignment = std::lcm(end_alignment, kMegatronHighBusBwAlignment);
  }
  LayoutBuilder builder(params.size(), end_alignment);
  // Backprop order: the last registered parameter's gradient is ready first.
  for (size_t i = params.size(); i-- > 0;) builder.Place(i, params[i], options.bucket_size);
  return builder.Finish();
}

Status CheckBucketNumels(const BucketLayout& layout, const std::vector<int64_t>& per_bucket_numel,
                         const std::vector<int64_t>& per_bucket_numel_unpadded,
                         const std::string& what) {
  std::vector<int64_t> numel, unpadded;
  for (const Bucket& b : layout.buckets) {
    numel.push_back(b.numel);
    unpadded.push_back(b.numel_unpadded);
  }
  if (per_bucket_numel_unpadded != unpadded) {
    return Status::InvalidInput(what + ": per_bucket_numel_unpadded " +
                                Numels(per_bucket_numel_unpadded) +
                                " is not Megatron's layout of its parameters, " + Numels(unpadded));
  }
  if (per_bucket_numel != numel) {
    return Status::InvalidInput(what + ": per_bucket_numel " + Numels(per_bucket_numel) +
                                " is not Megatron's padding of its buckets, " + Numels(numel) +
                                " (another DP size or bucket padding)");
  }
  return Status::Ok();
}

Result<BucketLayout> MegatronRecordedLayout(const std::vector<BucketParam>& params, BucketOptions options,
                                            const std::vector<int64_t>& per_bucket_numel,
                                            const std::vector<int64_t>& per_bucket_numel_unpadded,
                                            const std::string& what) {
  options.bucket_size = std::nullopt;
  RESHARD_ASSIGN_OR_RETURN(BucketLayout one, MegatronBucketLayout(params, options));
  const Status unbucketed = CheckBucketNumels(one, per_bucket_numel, per_bucket_numel_unpadded, what);
  if (unbucketed.ok()) return one;
  // A bucket size only adds buckets.
  if (per_bucket_numel_unpadded.size() <= one.buckets.size()) return unbucketed;
  std::vector<int64_t> sizes = per_bucket_numel_unpadded;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int64_t size : sizes) {
    if (size < 1) continue;
    options.bucket_size = size;
    RESHARD_ASSIGN_OR_RETURN(BucketLayout layout, MegatronBucketLayout(params, options));
    if (CheckBucketNumels(layout, per_bucket_numel, per_bucket_numel_unpadded, what).ok()) return layout;
  }
  return Status::InvalidInput(unbucketed.message() + ", nor at any bucket size (--ddp-bucket-size)");
}

std::vector<std::pair<int64_t, int64_t>> MegatronBucketChunks(const BucketLayout& layout,
                                                              int bucket, int dp) {
  const Bucket& b = layout.buckets[bucket];
  // Every chunk starts at a parameter's start or end or at a DP shard's start.
  std::vector<int64_t> cuts = {0, b.numel_unpadded};
  for (const BucketSlot& s : layout.slots) {
    if (s.bucket != bucket) continue;
    cuts.push_back(s.offset);
    cuts.push_back(s.offset + s.numel);
  }
  for (int r = 1; r < dp; ++r) cuts.push_back(r * (b.numel / dp));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (size_t i = 0; i + 1 < cuts.size() && cuts[i + 1] <= b.numel_unpadded; ++i) {
    chunks.emplace_back(cuts[i], cuts[i + 1] - cuts[i]);
  }
  return chunks;
}

std::string MegatronDpGroup::Prefix() const {
  return (chained >= 0 ? "chained_" + std::to_string(chained) + "." : std::string()) +
         "optimizer.distributed.dp_group_idx_" + std::to_string(dp_group_idx);
}

// Megatron-Core names a sharded object's item by its shard: shard 0 of 1.
std::string MegatronDpGroup::ItemKey(const std::string& name) const { return Prefix() + "." + name + "/shard_0_1"; }

std::string MegatronBucketKey(const MegatronDpGroup& group, int gbuf_idx, DType param_dtype, DType grad_dtype,
                              int bucket, const std::string& state) {
  return group.Prefix() + ".gbuf_idx_" + std::to_string(gbuf_idx) + ".dtype_(torch." + DTypeName(param_dtype) +
         ", torch." + DTypeName(grad_dtype) + ").bucket_idx_" + std::to_string(bucket) + "." + state;
}

int MegatronDpGroupIdx(int tp_rank, int pp_rank, int tp) { return tp_rank + tp * pp_rank; }

int MegatronExpertDpGroupIdx(int etp_rank, int ep_rank, int pp_rank, int etp, int ep) {
  return etp_rank + etp * (ep_rank + ep * pp_rank);
}

std::vector<RegisteredParam> SharedRegistrationOrder(const std::vector<RegisteredParam>& stage,
                                                     const std::function<bool(const std::string&)>& is_expert_key,
                                                     const OptimizerShare& share) {
  std::vector<RegisteredParam> params;
  for (size_t i = 0; i < stage.size();) {
    if (!is_expert_key(stage[i].key)) {
      if (share.dense) params.push_back(stage[i]);
      ++i;
      continue;
    }
    size_t end = i;  // the layer's run of expert keys: [i, end)
    while (end < stage.size() && stage[end].layer == stage[i].layer && is_expert_key(stage[end].key)) ++end;
    for (int64_t e = share.first_expert; e < share.first_expert + share.experts; ++e) {
      for (size_t j = i; j < end; ++j) params.push_back({stage[j].key, stage[j].layer, e});
    }
    i = end;
  }
  return params;
}

std::vector<RegisteredParam> StageRegistrationOrder(const std::vector<std::string>& order,
                                                    const std::function<bool(const std::string&)>& is_layer_key,
                                                    int64_t first_layer, int64_t layers, bool first_stage,
                                                    bool last_stage, const std::string& tied_head) {
  std::vector<RegisteredParam> params;
  std::vector<std::string> layer_keys;
  bool after_layers = false;
  auto flush_layers = [&] {
    for (int64_t l = first_layer; l < first_layer + layers; ++l) {
      for (const std::string& key : layer_keys) params.push_back({key, l});
    }
    layer_keys.clear();
  };
  for (const std::string& key : order) {
    if (is_layer_key(key)) {
      layer_keys.push_back(key);
      after_layers = true;
      continue;
    }
    flush_layers();
    if (after_layers ? last_stage : first_stage) params.push_back({key, -1});
  }
  flush_layers();
  if (last_stage && !tied_head.empty() && std::find(order.begin(), order.end(), tied_head) == order.end()) {
    params.push_back({tied_head, -1});
  }
  return params;
}

}  // namespace reshard
