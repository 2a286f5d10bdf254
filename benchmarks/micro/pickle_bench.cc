// Parsing (and writing) a large state-dict pickle.
//
// The pickle is what a big Megatron-DeepSpeed optimizer shard holds besides
// its tensor data: an OrderedDict of per-parameter tensors (each over its own
// storage, as torch.save writes them) and DeepSpeed's param_slice_mappings
// (one fragment_address object per parameter). It is built in memory and
// serialised with reshard's own writer, so the benchmark needs no files; the
// reader runs without a storage resolver (no tensor bytes are touched).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "formats/deepspeed/files/known_classes.h"
#include "pickle/pickle_reader.h"
#include "pickle/pickle_writer.h"
#include "pickle/value.h"

namespace reshard {
namespace {

// `layers` transformer blocks of 12 parameters each (GPT-2 style key names).
Value StateDict(int layers) {
  static const char* kKeys[] = {
      "input_layernorm.weight", "input_layernorm.bias",
      "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
      "self_attention.dense.weight", "self_attention.dense.bias",
      "post_attention_layernorm.weight", "post_attention_layernorm.bias",
      "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
      "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"};
  Items params, mappings;
  int64_t offset = 0;
  for (int layer = 0; layer < layers; ++layer) {
    for (const char* key : kKeys) {
      const std::string name = std::to_string(layer + 1) + "." + key;
      const bool matrix = std::string(key).find("weight") != std::string::npos &&
                          std::string(key).find("layernorm") == std::string::npos;
      const std::vector<int64_t> shape = matrix ? std::vector<int64_t>{1536, 1024}
                                                : std::vector<int64_t>{1024};
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      // A storage without bytes is enough for the pickle: the writer only
      // needs its dtype and size.
      Tensor t;
      t.storage = std::make_shared<Storage>();
      t.storage->dtype = DType::kBFloat16;
      t.storage->numel = numel;
      t.sizes = shape;
      t.strides = Tensor::ContiguousStrides(shape);
      params.emplace_back(Value::String(name), Value::MakeTensor(std::move(t)));

      Object address;
      address.cls = {"deepspeed.utils.tensor_fragment", "fragment_address"};
      address.construct = Object::Construct::kNewObj;
      address.state = std::make_shared<Value>(Value::MakeDict(
          {{Value::String("numel"), Value::Int(numel)}, {Value::String("start"), Value::Int(offset)}}));
      mappings.emplace_back(Value::String(name), Value::MakeObject(std::move(address)));
      offset += numel;
    }
  }
  return Value::MakeDict({{Value::String("module"), MakeOrderedDict(std::move(params))},
                          {Value::String("param_slice_mappings"),
                           Value::MakeList({MakeOrderedDict(std::move(mappings))})},
                          {Value::String("ds_version"), Value::String("0.14.0")}});
}

std::string Serialise(const Value& root) {
  Result<std::string> bytes = WritePickle(root, [](const std::string&, const Storage&) { return Status::Ok(); });
  if (!bytes.ok()) std::abort();
  return *bytes;
}

void BM_PickleParse(benchmark::State& state) {
  const std::string bytes = Serialise(StateDict(static_cast<int>(state.range(0))));
  PickleReadOptions options;
  options.known_classes = &DeepSpeedKnownClasses();  // fragment_address
  PickleReader reader(options, StorageResolver{});
  for (auto _ : state) {
    Result<Value> root = reader.Parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    if (!root.ok()) {
      state.SkipWithError(root.status().message().c_str());
      return;
    }
    benchmark::DoNotOptimize(root);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
  state.SetItemsProcessed(state.iterations() * state.range(0) * 12);  // parameters
  state.counters["pickle_KiB"] = static_cast<double>(bytes.size()) / 1024;
}
// 12 parameters per layer: 96 .. 9600 tensors (+ as many fragment_address objects).
BENCHMARK(BM_PickleParse)->Arg(8)->Arg(80)->Arg(800)->Unit(benchmark::kMicrosecond);

void BM_PickleWrite(benchmark::State& state) {
  const Value root = StateDict(static_cast<int>(state.range(0)));
  size_t size = 0;
  for (auto _ : state) {
    std::string bytes = Serialise(root);
    size = bytes.size();
    benchmark::DoNotOptimize(bytes);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
  state.SetItemsProcessed(state.iterations() * state.range(0) * 12);
}
BENCHMARK(BM_PickleWrite)->Arg(8)->Arg(80)->Arg(800)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace reshard
