#include "optim/state_tensor.h"

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

}  // namespace reshard
