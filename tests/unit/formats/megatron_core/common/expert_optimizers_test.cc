// The param groups of each optimizer Megatron-Core builds for a model with
// experts: one optimizer at EP 1, the dense parameters' then the experts'
// above, each with the groups of the multipliers its parameters have; and a
// ChainedOptimizer's groups read back as one optimizer's.
#include "formats/megatron_core/common/expert_optimizers.h"

#include <gtest/gtest.h>

#include "formats/megatron_core/common/megatron_param_groups.h"

namespace reshard {
namespace {

const char kExpert[] = "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.1.dense_h_to_4h.weight";
const char kExpertBias[] = "layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.1.dense_h_to_4h.bias";

// A decayed group (a dense matrix, and `decayed_expert`) and a group that
// is not (a norm, and `kept_expert` where given).
OptimizerParamGroups SourceGroups(const std::string& decayed_expert, const std::string& kept_expert) {
  OptimizerParamGroups groups;
  Value hyper = Value::MakeDict();
  Set(hyper, "lr", Value::Float(1e-3));
  Set(hyper, "weight_decay", Value::Float(0.01));
  groups.groups.push_back({hyper, 1.0, {"layers.0.self_attention.dense.weight", decayed_expert}});
  groups.groups.push_back({hyper, 0.0, {"layers.0.input_layernorm.weight"}});
  if (!kept_expert.empty()) groups.groups.back().params.push_back(kept_expert);
  groups.step = Value::Float(3.0);
  return groups;
}

Value MegatronGroups(const OptimizerParamGroups& source) {
  std::vector<std::string> notes;
  Result<Value> groups = MegatronParamGroups(source, LrSchedule{Value::Float(1e-3), Value::Float(0.0), "", ""},
                                             "0.19", &notes);
  EXPECT_TRUE(groups.ok()) << groups.status().message();
  return groups.ok() ? *groups : Value::MakeList({});
}

// Each group of an optimizer as (wd_mult, is_expert_parallel).
std::vector<std::pair<double, bool>> Described(const Value& groups) {
  std::vector<std::pair<double, bool>> out;
  for (const Value& g : groups.as_list().items) {
    out.emplace_back(Find(g, "wd_mult")->as_float(), Find(g, "is_expert_parallel")->as_bool());
  }
  return out;
}

using Groups = std::vector<std::pair<double, bool>>;

TEST(ExpertOptimizersTest, AtEp1OneOptimizerHoldsEveryGroup) {
  const OptimizerParamGroups source = SourceGroups(kExpert, "");
  const std::vector<Value> per = ParamGroupsPerOptimizer(MegatronGroups(source), source, {kExpert}, 1);
  ASSERT_EQ(per.size(), 1u);
  EXPECT_EQ(Described(per[0]), (Groups{{1.0, false}, {0.0, false}}));
}

TEST(ExpertOptimizersTest, AboveEp1TheExpertsHaveAnOptimizerOfTheirOwn) {
  const OptimizerParamGroups source = SourceGroups(kExpert, "");
  const std::vector<Value> per = ParamGroupsPerOptimizer(MegatronGroups(source), source, {kExpert}, 2);
  ASSERT_EQ(per.size(), 2u);
  EXPECT_EQ(Described(per[0]), (Groups{{1.0, false}, {0.0, false}}));
  // The experts' matrices decay: their optimizer has the decayed group alone.
  EXPECT_EQ(Described(per[1]), (Groups{{1.0, true}}));
  // Every other field is the group's, the step too.
  EXPECT_EQ(Find(per[1].as_list().items[0], "step")->as_float(), 3.0);
  EXPECT_EQ(Find(per[1].as_list().items[0], "max_lr")->as_float(), 1e-3);
}

TEST(ExpertOptimizersTest, ExpertBiasesBringTheGroupThatDoesNotDecay) {
  const OptimizerParamGroups source = SourceGroups(kExpert, kExpertBias);
  const std::vector<Value> per =
      ParamGroupsPerOptimizer(MegatronGroups(source), source, {kExpert, kExpertBias}, 4);
  ASSERT_EQ(per.size(), 2u);
  EXPECT_EQ(Described(per[1]), (Groups{{1.0, true}, {0.0, true}}));
}

TEST(ExpertOptimizersTest, AModelWithoutExpertsHasOneOptimizer) {
  const OptimizerParamGroups source = SourceGroups("layers.0.mlp.dense_h_to_4h.weight", "");
  EXPECT_EQ(ParamGroupsPerOptimizer(MegatronGroups(source), source, {}, 2).size(), 1u);
}

TEST(ExpertOptimizersTest, AChainedOptimizersGroupsReadBackAsOneOptimizers) {
  const OptimizerParamGroups source = SourceGroups(kExpert, kExpertBias);
  const Value megatron = MegatronGroups(source);
  std::vector<Value> chained;
  for (const Value& groups : ParamGroupsPerOptimizer(megatron, source, {kExpert, kExpertBias}, 2)) {
    chained.insert(chained.end(), groups.as_list().items.begin(), groups.as_list().items.end());
  }
  ASSERT_EQ(chained.size(), 4u);
  Result<std::vector<Value>> one = ParamGroupsAsOneOptimizer(chained);
  ASSERT_TRUE(one.ok()) << one.status().message();
  ASSERT_EQ(one->size(), 2u);
  for (size_t g = 0; g < one->size(); ++g) {
    EXPECT_EQ((*one)[g].DebugString(1 << 16), megatron.as_list().items[g].DebugString(1 << 16));
  }
}

TEST(ExpertOptimizersTest, AnExpertGroupOfItsOwnHyperparametersIsRefused) {
  const OptimizerParamGroups source = SourceGroups(kExpert, "");
  std::vector<Value> chained;
  for (const Value& groups : ParamGroupsPerOptimizer(MegatronGroups(source), source, {kExpert}, 2)) {
    chained.insert(chained.end(), groups.as_list().items.begin(), groups.as_list().items.end());
  }
  Set(chained.back(), "lr", Value::Float(1e-4));  // the experts' learning rate, set apart
  Result<std::vector<Value>> one = ParamGroupsAsOneOptimizer(chained);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), Status::Code::kUnsupported);
  EXPECT_NE(one.status().message().find("the experts' optimizer param group with wd_mult 1.0 differs from the "
                                        "dense parameters' in more than is_expert_parallel"),
            std::string::npos)
      << one.status().message();
}

}  // namespace
}  // namespace reshard
