#include "optim/state_tensor.h"

#include <cstring>

#include "exec/materialize.h"
#include "plan/stages.h"

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

Result<bool> WeightFromMaster(const LogicalCheckpoint& src, const SourceOptimizer& opt,
                              const TensorPlan& plan, std::vector<uint8_t>* out) {
  const std::string name = ParamName(src, plan.layer_index, plan.tensor_index);
  if (!opt.Has(name)) return false;
  RESHARD_ASSIGN_OR_RETURN(StateTensor master, StateTensor::Gather(src, opt, name, kMasterState));
  std::vector<uint8_t> merged;
  MaterializeTensor(master.tensor(), plan, &merged);
  const DType dtype = src.layers[plan.layer_index].tensors[plan.tensor_index].dtype;
  const int es = ElementSize(dtype);
  out->assign(merged.size() / 4 * es, 0);
  for (size_t i = 0; i < merged.size() / 4; ++i) {
    StoreFromDouble(dtype, LoadAsDouble(DType::kFloat32, merged.data() + 4 * i), out->data() + i * es);
  }
  return true;
}

Result<int64_t> MaterializeWeight(const LogicalCheckpoint& src, const SourceOptimizer* masters,
                                  const LogicalTensor& weight, const TensorPlan& plan,
                                  std::vector<uint8_t>* out) {
  if (plan.average && masters != nullptr) {
    RESHARD_ASSIGN_OR_RETURN(bool from_master, WeightFromMaster(src, *masters, plan, out));
    if (from_master) return int64_t{0};
  }
  return MaterializeTensor(weight, plan, out);
}

}  // namespace reshard
