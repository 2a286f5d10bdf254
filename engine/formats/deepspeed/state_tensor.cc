#include "formats/deepspeed/state_tensor.h"

#include <cstring>

#include "plan/materialize.h"
#include "formats/deepspeed/stages.h"

namespace reshard {

Result<StateTensor> StateTensor::Gather(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                        const std::string& name, const std::string& state) {
  StateTensor st;
  if (!ResolveParamName(src, name, &st.layer_index_, &st.tensor_index_)) {
    return Status::InvalidInput("the optimizer shards hold " + name +
                                ", which is not a tensor of the layer files");
  }
  const LogicalTensor& weight = src.layers[st.layer_index_].tensors[st.tensor_index_];
  st.shards_.reserve(src.tp);
  for (int t = 0; t < src.tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(std::vector<uint8_t> gathered, opt.Gather(name, t, state));
    auto bytes = std::make_shared<std::vector<uint8_t>>(std::move(gathered));
    st.shards_.push_back(MakeOwnedTensor(DType::kFloat32, weight.local_shape, bytes).as_tensor());
  }
  st.tensor_ = weight;
  st.tensor_.dtype = DType::kFloat32;
  st.tensor_.shards.clear();
  for (const Tensor& t : st.shards_) st.tensor_.shards.push_back(&t);
  return st;
}

Result<std::vector<StateDrift>> MeasureStateDrift(const LogicalCheckpoint& src,
                                                  const SourceOptimizer& opt) {
  std::vector<StateDrift> drifts;
  for (const std::string& name : opt.ParamNames()) {
    int li = 0, ti = 0;
    if (!ResolveParamName(src, name, &li, &ti)) continue;  // reported when gathered
    const ParamRule* rule = src.layers[li].tensors[ti].rule;
    if (rule->policy != ParamRule::Policy::kReplicated) continue;
    for (const std::string& state : opt.states()) {
      RESHARD_ASSIGN_OR_RETURN(StateTensor st, StateTensor::Gather(src, opt, name, state));
      const LogicalTensor& t = st.tensor();
      const size_t bytes = static_cast<size_t>(t.shards[0]->numel()) * 4;
      for (int r = 1; r < src.tp; ++r) {
        if (std::memcmp(TensorData(*t.shards[0]), TensorData(*t.shards[r]), bytes) != 0) {
          drifts.push_back({name, state, rule, r});
          break;
        }
      }
    }
  }
  return drifts;
}

namespace {

// Element range of a byte range of a tensor of `element_size`-byte elements.
Status ToElements(int64_t offset, int64_t length, int element_size, int64_t* begin, int64_t* end) {
  if (offset % element_size != 0 || length % element_size != 0) {
    return Status::Internal("tensor bytes requested in a range not of whole elements");
  }
  *begin = offset / element_size;
  *end = *begin + length / element_size;
  return Status::Ok();
}

ByteProducer CopiedWeight(SourceTensor source, TensorPlan plan, std::atomic<int64_t>* read) {
  return [source = std::move(source), plan = std::move(plan), read](
             int64_t offset, int64_t length, uint8_t* dst) {
    int64_t begin = 0, end = 0;
    RESHARD_RETURN_IF_ERROR(ToElements(offset, length, ElementSize(source.dtype), &begin, &end));
    TouchedPages pages;
    *read += MaterializeRange(source, plan, begin, end, dst, &pages);
    return Status::Ok();
  };
}

// The averaged masters, a block at a time, cast to `dtype`.
ByteProducer WeightOfMaster(SourceTensor master, TensorPlan plan, DType dtype,
                            std::atomic<int64_t>* read) {
  return [master = std::move(master), plan = std::move(plan), dtype, read](
             int64_t offset, int64_t length, uint8_t* dst) {
    int64_t begin = 0, end = 0;
    const int es = ElementSize(dtype);
    RESHARD_RETURN_IF_ERROR(ToElements(offset, length, es, &begin, &end));
    constexpr int64_t kBlock = 1 << 14;
    std::vector<uint8_t> fp32(static_cast<size_t>(std::min(kBlock, end - begin)) * 4);
    TouchedPages pages;
    for (int64_t at = begin; at < end; at += kBlock) {
      const int64_t n = std::min(kBlock, end - at);
      *read += MaterializeRange(master, plan, at, at + n, fp32.data(), &pages);
      for (int64_t i = 0; i < n; ++i) {
        StoreFromDouble(dtype, LoadAsDouble(DType::kFloat32, fp32.data() + 4 * i),
                        dst + (at - begin + i) * es);
      }
    }
    return Status::Ok();
  };
}

}  // namespace

Result<ByteProducer> WeightProducer(const LogicalCheckpoint& src, const SourceOptimizer* masters,
                                    const LogicalTensor& weight, const TensorPlan& plan,
                                    std::atomic<int64_t>* read) {
  const std::string name = ParamName(src, plan.layer_index, plan.tensor_index);
  if (!plan.average || masters == nullptr || !masters->Has(name)) {
    return CopiedWeight(SourceTensor::Of(weight), plan, read);
  }
  SourceTensor master;
  master.local_shape = weight.local_shape;
  for (int t = 0; t < src.tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(SourceShard shard, masters->Locate(name, t, kMasterState));
    master.shards.push_back(std::move(shard));
  }
  return WeightOfMaster(std::move(master), plan, weight.dtype, read);
}

Status MaterializeWeight(const LogicalCheckpoint& src, const SourceOptimizer* masters,
                         const LogicalTensor& weight, const TensorPlan& plan,
                         std::vector<uint8_t>* out) {
  std::atomic<int64_t> read{0};
  RESHARD_ASSIGN_OR_RETURN(ByteProducer produce, WeightProducer(src, masters, weight, plan, &read));
  out->resize(static_cast<size_t>(plan.numel()) * ElementSize(weight.dtype));
  return produce(0, static_cast<int64_t>(out->size()), out->data());
}

}  // namespace reshard
