#include "rules/size_expression.h"

#include <gtest/gtest.h>

#include <map>

#include "formats/hf_common/torchtitan_rules.h"
#include "rules/builtin_rules.h"
#include "rules/rule_set.h"

namespace reshard {
namespace {

// q: [32, 16], k: [16, 16]; 4 heads; 2 blocks.
std::optional<int64_t> Lookup(const std::string& name, int64_t dim) {
  static const std::map<std::string, std::vector<int64_t>> shapes = {{"layers.0.wq.weight", {32, 16}},
                                                                    {"layers.0.wk.weight", {16, 16}}};
  if (dim >= 0) {
    auto it = shapes.find(name);
    if (it == shapes.end() || dim >= static_cast<int64_t>(it->second.size())) return std::nullopt;
    return it->second[dim];
  }
  if (name == "heads") return 4;
  if (name == "blocks") return 2;
  return std::nullopt;
}

int64_t Value(const std::string& text) {
  Result<SizeExpression> e = ParseSizeExpression(text);
  EXPECT_TRUE(e.ok()) << e.status().message();
  Result<int64_t> v = EvaluateSize(*e, Lookup);
  EXPECT_TRUE(v.ok()) << v.status().message();
  return v.ok() ? *v : -1;
}

TEST(SizeExpression, ProductsAndQuotientsOfDimsAndNames) {
  EXPECT_EQ(Value("layers.0.wq.weight[1]"), 16);
  EXPECT_EQ(Value("blocks"), 2);
  EXPECT_EQ(Value("7"), 7);
  // KV heads of a GQA projection: heads * rows(k) / rows(q).
  EXPECT_EQ(Value("heads * layers.0.wk.weight[0] / layers.0.wq.weight[0]"), 2);
  EXPECT_EQ(Value(" 2*blocks "), 4);
}

TEST(SizeExpression, RefusesWhatItCannotComputeWithTheReason) {
  for (const char* bad : {"", "a +b", "x[-1]", "x[", "0", "x[one]"}) {
    EXPECT_FALSE(ParseSizeExpression(bad).ok()) << bad;
  }
  Result<int64_t> unknown = EvaluateSize(*ParseSizeExpression("heads * kv"), Lookup);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("kv is not known"), std::string::npos) << unknown.status().message();
  Result<int64_t> missing_dim = EvaluateSize(*ParseSizeExpression("layers.0.wq.weight[2]"), Lookup);
  EXPECT_FALSE(missing_dim.ok());
  Result<int64_t> inexact = EvaluateSize(*ParseSizeExpression("blocks / heads"), Lookup);
  ASSERT_FALSE(inexact.ok());
  EXPECT_NE(inexact.status().message().find("is not a multiple of heads = 4"), std::string::npos)
      << inexact.status().message();
}

// The built-in Llama sets read torchtitan: every q / k entry interleaved,
// every size a valid expression.
TEST(RuleSetTorchtitan, BuiltinLlamaSetsMapTorchtitansKeys) {
  for (const char* name : {"megatron-llama", "megatron-llama-tied"}) {
    SCOPED_TRACE(name);
    Result<RuleSet> rs = LoadRuleSet(name);
    ASSERT_TRUE(rs.ok()) << rs.status().message();
    const TorchtitanLayout* tt = rs->section<TorchtitanLayout>();
    ASSERT_NE(tt, nullptr);
    int interleaved = 0;
    for (const TorchtitanTensor& t : tt->tensors) {
      EXPECT_FALSE(t.keys.empty());
      interleaved += !t.interleaved_heads.empty();
      if (t.hf.find("q_proj") != std::string::npos) EXPECT_EQ(t.interleaved_heads, "num_attention_heads");
      // torchtitan's TP plan: norms replicated, o_proj and down_proj row-parallel, the rest Shard(0)
      const bool norm = t.hf.find("norm") != std::string::npos;
      const bool row_parallel = t.hf.find("o_proj") != std::string::npos || t.hf.find("down_proj") != std::string::npos;
      EXPECT_EQ(t.tp_dim, norm ? -1 : row_parallel ? 1 : 0) << t.hf;
    }
    EXPECT_EQ(interleaved, 2);
  }
}

TEST(RuleSetTorchtitan, ReportsWhatIsWrongWithTheSection) {
  const std::string base = R"(name: t
pipeline:
  specs: [{embedding: EmbeddingPipe}, {block: ParallelTransformerLayerPipe}]
layers:
  embedding:
    - {key: 'w', split: vocab}
  block:
    - {key: 'n', replicated: true}
vocab:
  original_size: [a.b]
)";
  Result<RuleSet> no_hf = RuleSet::LoadString(base + "torchtitan:\n  tensors:\n    - {hf: a, key: b}\n", "t.yaml");
  ASSERT_FALSE(no_hf.ok());
  EXPECT_NE(no_hf.status().message().find("which this file lacks; add an hf section"), std::string::npos)
      << no_hf.status().message();
}

}  // namespace
}  // namespace reshard
