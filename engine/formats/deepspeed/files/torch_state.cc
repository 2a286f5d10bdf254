#include "formats/deepspeed/files/torch_state.h"

#include <cstdio>

#include "logical/source_shard.h"
#include "pickle/dtype.h"

namespace reshard {

const Value* TorchGroupState(const Value* torch_state_dict, int group) {
  const Value* state = torch_state_dict != nullptr ? Find(*torch_state_dict, "state") : nullptr;
  const Items* items = state != nullptr ? DictItems(*state) : nullptr;
  if (items == nullptr) return nullptr;
  for (const auto& [k, v] : *items) {
    int64_t g;
    if (ReadInt(k, &g) && g == group) return &v;
  }
  return nullptr;
}

Value* MutableTorchGroupState(Value* torch_state_dict, int group) {
  return const_cast<Value*>(TorchGroupState(torch_state_dict, group));
}

const std::vector<Value>* ParamGroups(const Value& torch_state_dict) {
  const Value* groups = Find(torch_state_dict, "param_groups");
  return groups != nullptr && groups->is(Value::Kind::kList) ? &groups->as_list().items : nullptr;
}

std::string ScalarBytes(const Value& v) {
  if (!v.is(Value::Kind::kTensor)) return v.DebugString(1 << 20);
  const Tensor& t = v.as_tensor();
  if (t.storage == nullptr || t.storage->bytes.data == nullptr || !t.IsContiguous()) return v.DebugString();
  const size_t n = static_cast<size_t>(t.numel()) * ElementSize(t.storage->dtype);
  return std::string(reinterpret_cast<const char*>(TensorData(t)), n);
}

std::string ScalarText(const Value* v) {
  if (v == nullptr) return "missing";
  if (!v->is(Value::Kind::kTensor)) return v->DebugString(60);
  const Tensor& t = v->as_tensor();
  if (t.numel() != 1 || t.storage == nullptr || t.storage->bytes.data == nullptr) return v->DebugString(60);
  char text[32];
  std::snprintf(text, sizeof(text), "%g", LoadAsDouble(t.storage->dtype, TensorData(t)));
  return std::string("tensor(") + text + ")";
}

const Tensor* ParamTensor(const Value* v, const std::vector<int64_t>& shape) {
  if (v == nullptr || !v->is(Value::Kind::kTensor)) return nullptr;
  const Tensor& t = v->as_tensor();
  if (t.storage == nullptr || t.storage->dtype != DType::kFloat32 || t.sizes != shape ||
      !t.IsContiguous() || t.storage_offset + t.numel() > t.storage->numel) {
    return nullptr;
  }
  return &t;
}

std::string Hyperparameters(const Value& group) {
  std::string out;
  if (const Items* items = DictItems(group)) {
    for (const auto& [k, v] : *items) {
      if (!(k.is(Value::Kind::kString) && k.as_string() == "params")) {
        out += k.DebugString() + "=" + ScalarBytes(v) + ";";
      }
    }
  }
  return out;
}

}  // namespace reshard
