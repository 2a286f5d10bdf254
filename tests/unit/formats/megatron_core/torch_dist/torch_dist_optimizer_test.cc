#include "formats/megatron_core/torch_dist/torch_dist_optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "container/torch_file.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "rules/rule_set.h"
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

// ---- Megatron-Core 0.19's MoE saves --------------------------------------

const std::string kMoe = std::string(RESHARD_SOURCE_DIR) + "/tests/data/megatron-core/0.19-moe/";
const std::string kExpertFc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight";

const TorchDistLayout& MoeLayout() {
  static const RuleSet rules = [] {
    Result<RuleSet> rs = RuleSet::LoadFile(std::string(RESHARD_SOURCE_DIR) + "/rules/megatron-core-moe.yaml");
    EXPECT_TRUE(rs.ok()) << rs.status().message();
    return rs.ok() ? std::move(*rs) : RuleSet();
  }();
  return *rules.section<TorchDistLayout>();
}

// The optimizer state of save `folder` (its common state from the
// common_state item, as Megatron-Core 0.19 keeps it).
Result<TorchDistOptimizer> ReadMoe(const std::string& folder, const TorchDistLayout& layout) {
  RESHARD_ASSIGN_OR_RETURN(DcpContent c, ReadDcpContent(kMoe + folder));
  RESHARD_ASSIGN_OR_RETURN(Value common, c.ReadBytes("common_state/shard_0_1"));
  RESHARD_ASSIGN_OR_RETURN(std::optional<TorchDistOptimizer> read,
                           ReadTorchDistOptimizer(c, common.as_list().items.at(0), layout,
                                                  [](const std::string&) { return std::optional<int64_t>(); }));
  if (!read) return Status::InvalidInput(folder + " holds no optimizer state");
  return std::move(*read);
}

// The elements of every state of every key of `got` that differ from `want`'s.
int64_t Differing(const TorchDistOptimizer& got, const TorchDistOptimizer& want, int64_t* compared) {
  int64_t differing = 0;
  for (const char* state : kTorchDistStates) {
    EXPECT_EQ(got.states.at(state).size(), want.states.at(state).size()) << state;
    for (const auto& [key, t] : want.states.at(state)) {
      const std::vector<uint8_t> a = Bytes(got.states.at(state).at(key)), b = Bytes(t);
      EXPECT_EQ(a.size(), b.size()) << key;
      for (size_t i = 0; i + 4 <= std::min(a.size(), b.size()); i += 4) differing += std::memcmp(&a[i], &b[i], 4) != 0;
      *compared += static_cast<int64_t>(b.size() / 4);
    }
  }
  return differing;
}

// The dp_reshardable state of each real MoE save, read through its buckets
// (at EP 2 a ChainedOptimizer's: the dense parameters' `chained_0.` and
// each EP rank's experts' `chained_1.`), is its fully_reshardable twin's,
// element for element; and so are the param groups, read as one optimizer's.
TEST(TorchDistOptimizerTest, MoeDpReshardableIsItsFullyReshardableTwin) {
  for (const std::string tag : {"w2_ep2", "w2_tp2_ep1"}) {
    SCOPED_TRACE(tag);
    Result<TorchDistOptimizer> dp = ReadMoe(tag + "_optim_dp_reshardable", MoeLayout());
    Result<TorchDistOptimizer> full = ReadMoe(tag + "_optim_fully_reshardable", MoeLayout());
    ASSERT_TRUE(dp.ok()) << dp.status().message();
    ASSERT_TRUE(full.ok()) << full.status().message();
    EXPECT_EQ(dp->layout, "dp_reshardable");
    int64_t compared = 0;
    EXPECT_EQ(Differing(*dp, *full, &compared), 0);
    EXPECT_EQ(compared, 3 * 12064);  // 13 keys: 2 x 4 experts x 2 x 512, and the dense 3872
    EXPECT_EQ(dp->states.at("param").size(), 13u);
    ASSERT_EQ(dp->param_groups.size(), full->param_groups.size());
    for (size_t g = 0; g < dp->param_groups.size(); ++g) {
      EXPECT_EQ(dp->param_groups[g].DebugString(1 << 12), full->param_groups[g].DebugString(1 << 12));
    }
  }
}

// A registration order that puts each expert's linear_fc2 before its
// linear_fc1 (of equal numels, so the bucket numels cannot tell) reads other
// elements: the comparison above catches an order that is not Megatron's.
TEST(TorchDistOptimizerTest, MoeDpReshardableInAnotherExpertOrderDiffers) {
  TorchDistLayout swapped = MoeLayout();
  std::vector<std::string>& order = swapped.optimizer_order;
  auto fc1 = std::find(order.begin(), order.end(), kExpertFc1);
  ASSERT_NE(fc1, order.end());
  std::iter_swap(fc1, fc1 + 1);
  for (const std::string tag : {"w2_ep2", "w2_tp2_ep1"}) {
    SCOPED_TRACE(tag);
    Result<TorchDistOptimizer> dp = ReadMoe(tag + "_optim_dp_reshardable", swapped);
    Result<TorchDistOptimizer> full = ReadMoe(tag + "_optim_fully_reshardable", MoeLayout());
    ASSERT_TRUE(dp.ok()) << dp.status().message();
    ASSERT_TRUE(full.ok()) << full.status().message();
    int64_t compared = 0;
    EXPECT_GT(Differing(*dp, *full, &compared), 3 * 4096);  // the experts' states, nearly every element
  }
}

}  // namespace
}  // namespace reshard
