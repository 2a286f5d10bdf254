#include "formats/megatron_core/torch_dist/torch_dist_optimizer.h"

#include <gtest/gtest.h>

#include <cstring>

#include "container/torch_file.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "util/shape.h"

namespace reshard {
namespace {

// A real Megatron-Core 0.14 save (TP 2) after one AdamW step.
const std::string kSave =
    std::string(RESHARD_SOURCE_DIR) + "/tests/data/megatron-core/0.14/w2_tp2_optim_fully_sharded_model_space";
const std::string kQkv = "decoder.layers.self_attention.linear_qkv.weight";

DcpContent Content() {
  Result<DcpContent> c = ReadDcpContent(kSave);
  EXPECT_TRUE(c.ok()) << c.status().message();
  return c.ok() ? std::move(*c) : DcpContent{};
}

Result<std::optional<TorchDistOptimizer>> Read(const DcpContent& c) {
  PickleReadOptions options;
  options.inert_packages = MegatronPackages();
  Result<Value> common = ReadTorchFile(kSave + "/common.pt", options);
  EXPECT_TRUE(common.ok()) << common.status().message();
  static const TorchDistLayout layout;  // read without the rule set's registration order
  return ReadTorchDistOptimizer(c, common.ok() ? *common : Value::None(), layout,
                                [](const std::string&) { return std::optional<int64_t>(); });
}

// The bytes of `t`'s elements in row-major order.
std::vector<uint8_t> Bytes(const DcpTensor& t) {
  const SourceShard all = SliceRuns(t, -1);
  std::vector<uint8_t> out(ShapeNumel(t.size) * ElementSize(t.dtype));
  all.Copy(0, ShapeNumel(t.size), ElementSize(t.dtype), out.data(), nullptr);
  return out;
}

// In fp32 training the master is the weight: every element of every key's
// fp32_param, placed back, equals the weight saved beside it.
TEST(TorchDistOptimizerTest, FullyShardedModelSpaceMastersAreTheWeights) {
  const DcpContent c = Content();
  Result<std::optional<TorchDistOptimizer>> read = Read(c);
  ASSERT_TRUE(read.ok()) << read.status().message();
  ASSERT_TRUE(read->has_value());
  const TorchDistOptimizer& opt = **read;
  EXPECT_EQ(opt.layout, "fully_sharded_model_space");
  int64_t elements = 0;
  for (const char* state : kTorchDistStates) {
    ASSERT_EQ(opt.states.at(state).size(), 16u) << state;
    for (const auto& [key, t] : opt.states.at(state)) {
      const DcpTensor& weight = *c.FindTensor(key);
      EXPECT_EQ(t.size, weight.size) << key;
      const std::vector<uint8_t> got = Bytes(t), want = Bytes(weight);
      if (std::string(state) == kTorchDistStates[0]) {
        EXPECT_EQ(got, want) << key;
        elements += ShapeNumel(t.size);
      } else {
        EXPECT_NE(got, want) << state << " " << key;
      }
    }
  }
  EXPECT_EQ(elements, 5984);
  ASSERT_EQ(opt.param_groups.size(), 2u);
  EXPECT_EQ(Find(opt.param_groups[0], "params"), nullptr);
  ASSERT_TRUE(opt.step.has_value());
  EXPECT_EQ(opt.step->as_float(), 1.0);
}

void ExpectOneLineError(const DcpContent& c, const std::string& problem) {
  Result<std::optional<TorchDistOptimizer>> read = Read(c);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), Status::Code::kInvalidInput);
  const std::string& message = read.status().message();
  EXPECT_NE(message.find(problem), std::string::npos) << message;
  EXPECT_NE(message.find("--weights-only"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(TorchDistOptimizerTest, FullyShardedModelSpaceThatDoesNotFitItsKeysIsRefused) {
  const std::string fqn = "optimizer.state.exp_avg." + kQkv;
  {
    DcpContent c = Content();
    c.meta.nd_reformulated_orig_shapes[fqn] = {2, 30, 16};
    ExpectOneLineError(c, "reformulates a tensor of shape [2, 30, 16], not [2, 32, 16]");
  }
  {
    DcpContent c = Content();
    c.meta.nd_reformulated_orig_shapes.erase(fqn);
    ExpectOneLineError(c, "records no original shape");
  }
  {
    DcpContent c = Content();
    for (DcpTensor& t : c.tensors) {
      if (t.fqn == fqn) t.size = {2, 2, 1, 128};  // half a fragment's numel
    }
    ExpectOneLineError(c, "is no reformulation of its original shape [2, 32, 16]");
  }
}

}  // namespace
}  // namespace reshard
