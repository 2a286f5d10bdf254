// CheckSplittable's refusals name what does not divide: the blocks (heads,
// KV heads) by the value that gave their count, else the rows.
#include "plan/tensor_plan.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

// A fused GQA QKV as megatron-llama splits it: dim 0 in KV-group blocks.
LogicalTensor GqaQkv(const ParamRule* rule, int64_t kv_heads, int64_t rows) {
  LogicalTensor t;
  t.label = "layer_02/self_attention.query_key_value.weight";
  t.rule = rule;
  t.full_shape = {rows, 64};
  t.blocks = kv_heads;
  t.blocks_from = "args.num_key_value_heads";
  return t;
}

ParamRule SplitRule() {
  ParamRule rule;
  rule.policy = ParamRule::Policy::kSplit;
  rule.blocks.alternatives = {"args.num_key_value_heads", "args.num_attention_heads"};
  return rule;
}

TEST(CheckSplittableTest, GqaNamesTheKvHeads) {
  const ParamRule rule = SplitRule();
  const Status st = CheckSplittable(GqaQkv(&rule, 2, 160), 3);
  EXPECT_NE(st.message().find("its 2 KV heads (args.num_key_value_heads) do not divide by 3"), std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("rows per part"), std::string::npos) << st.message();
}

TEST(CheckSplittableTest, OneBlockIsSingular) {
  const ParamRule rule = SplitRule();
  const Status st = CheckSplittable(GqaQkv(&rule, 1, 80), 2);
  EXPECT_NE(st.message().find("its 1 KV head (args.num_key_value_heads) does not divide by 2"), std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("1 blocks"), std::string::npos) << st.message();
}

TEST(CheckSplittableTest, DividingBlocksPass) {
  const ParamRule rule = SplitRule();
  EXPECT_TRUE(CheckSplittable(GqaQkv(&rule, 4, 320), 2).ok());
}

TEST(CheckSplittableTest, RowsWithoutBlocks) {
  ParamRule rule;
  rule.policy = ParamRule::Policy::kSplit;
  LogicalTensor t;
  t.label = "layer_02/mlp.dense_h_to_4h.weight";
  t.rule = &rule;
  t.full_shape = {10, 4};
  const Status st = CheckSplittable(t, 3);
  EXPECT_NE(st.message().find("its 10 rows per part do not divide by 3"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace reshard
