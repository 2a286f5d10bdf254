#include "formats/deepspeed/optimizer/state_tensor.h"

#include <cstring>

#include "formats/deepspeed/model/stages.h"
#include "plan/materialize.h"

namespace reshard {

Result<StateTensor> LocateState(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                                const std::string& name, const std::string& state) {
  StateTensor st;
  if (!ResolveParamName(src, name, &st.layer_index, &st.tensor_index)) {
    return Status::InvalidInput("the optimizer shards hold " + name +
                                ", which is not a tensor of the layer files");
  }
  st.tensor = src.layers[st.layer_index].tensors[st.tensor_index];
  st.tensor.dtype = DType::kFloat32;
  st.tensor.shards.clear();
  for (int t = 0; t < src.tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(SourceShard shard, opt.Locate(name, t, state));
    st.tensor.shards.push_back(std::move(shard));
  }
  return st;
}

bool SameElements(const SourceShard& a, const SourceShard& b, int64_t n, int element_size) {
  constexpr int64_t kBlock = 1 << 14;
  std::vector<uint8_t> da(static_cast<size_t>(kBlock) * element_size), db(da.size());
  for (int64_t at = 0; at < n; at += kBlock) {
    const int64_t len = std::min(kBlock, n - at);
    TouchedPages pages;
    a.Copy(at, len, element_size, da.data(), &pages);
    b.Copy(at, len, element_size, db.data(), &pages);
    if (std::memcmp(da.data(), db.data(), static_cast<size_t>(len) * element_size) != 0) return false;
  }
  return true;
}

Result<std::vector<StateDrift>> MeasureStateDrift(const LogicalCheckpoint& src,
                                                  const SourceOptimizer& opt) {
  std::vector<StateDrift> drifts;
  for (const std::string& name : opt.ParamNames()) {
    int li = 0, ti = 0;
    if (!ResolveParamName(src, name, &li, &ti)) continue;  // reported when located
    const ParamRule* rule = src.layers[li].tensors[ti].rule;
    if (rule->policy != ParamRule::Policy::kReplicated) continue;
    for (const std::string& state : opt.states()) {
      RESHARD_ASSIGN_OR_RETURN(StateTensor st, LocateState(src, opt, name, state));
      const LogicalTensor& t = st.tensor;
      for (int r = 1; r < src.tp; ++r) {
        if (!SameElements(t.shards[0], t.shards[r], t.shards[0].numel(), 4)) {
          drifts.push_back({name, state, rule, r});
          break;
        }
      }
    }
  }
  return drifts;
}

namespace {

// The masters `plan` makes a weight of (averaged, or a universal
// checkpoint's whole ones), a block at a time, cast to `dtype`.
ByteProducer WeightOfMaster(SourceTensor master, TensorPlan plan, DType dtype,
                            std::atomic<int64_t>* read) {
  return [master = std::move(master), plan = std::move(plan), dtype, read](
             int64_t offset, int64_t length, uint8_t* dst) {
    int64_t begin = 0, end = 0;
    const int es = ElementSize(dtype);
    RESHARD_RETURN_IF_ERROR(ElementRange(offset, length, es, &begin, &end));
    constexpr int64_t kBlock = 1 << 14;
    std::vector<uint8_t> fp32(static_cast<size_t>(std::min(kBlock, end - begin)) * 4);
    TouchedPages pages;
    for (int64_t at = begin; at < end; at += kBlock) {
      const int64_t n = std::min(kBlock, end - at);
      *read += MaterializeRange(master, plan, at, at + n, fp32.data(), &pages);
      ConvertElements(DType::kFloat32, fp32.data(), n, dtype, dst + (at - begin) * es);
    }
    return Status::Ok();
  };
}

}  // namespace

Result<ByteProducer> WeightProducer(const LogicalCheckpoint& src, const SourceOptimizer* masters,
                                    const LogicalTensor& weight, const TensorPlan& plan,
                                    std::atomic<int64_t>* read) {
  if (src.weights_from_masters && IsFloatingPoint(weight.dtype)) {  // its shards are its master
    return WeightOfMaster(SourceTensor::Of(weight), plan, src.WeightDType(weight), read);
  }
  const std::string name = ParamName(src, plan.layer_index, plan.tensor_index);
  if (!plan.average || masters == nullptr || !masters->HasMasters() || !masters->Has(name)) {
    return RangeProducer(SourceTensor::Of(weight), plan, read);
  }
  SourceTensor master;
  for (int t = 0; t < src.tp; ++t) {
    RESHARD_ASSIGN_OR_RETURN(SourceShard shard, masters->Locate(name, t, kMasterState));
    master.shards.push_back(std::move(shard));
  }
  return WeightOfMaster(std::move(master), plan, weight.dtype, read);
}

}  // namespace reshard
