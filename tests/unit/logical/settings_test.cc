// --set values: parsed into a dict of the metadata's shape, refused when no
// rule reads them or when they contradict what the checkpoint records.
#include "logical/settings.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

const char kRules[] = R"(
name: tiny
detect:
  args: {swiglu: false}
pipeline:
  specs:
    - block: Block
vocab:
  original_size: [universal_checkpoint_info.original_vocab_size, 64]
layers:
  block:
    - key: 'qkv\.weight'
      split: {dim: 0, blocks: args.num_attention_heads}
)";

RuleSet Rules() {
  Result<RuleSet> rules = RuleSet::LoadString(kRules, "tiny.yaml");
  EXPECT_TRUE(rules.ok()) << rules.status().message();
  return std::move(*rules);
}

Value Metadata(Items args) {
  return Value::MakeDict({{Value::String("args"), Value::MakeDict(std::move(args))}});
}

TEST(Settings, KeysArePathsAndBareNamesMeanArgs) {
  Result<Value> v = SettingsValue({{"num_attention_heads", "4"},
                                   {"universal_checkpoint_info.original_vocab_size", "50257"},
                                   {"args.swiglu", "false"},
                                   {"args.pp_partition_method", "type:transformer"}});
  ASSERT_TRUE(v.ok()) << v.status().message();
  const Value none = Value::MakeDict();
  const RuleInputs inputs{none, *v};
  ASSERT_NE(inputs.Find("args.num_attention_heads"), nullptr);
  EXPECT_EQ(inputs.Find("args.num_attention_heads")->as_int(), 4);
  EXPECT_EQ(inputs.Find("universal_checkpoint_info.original_vocab_size")->as_int(), 50257);
  EXPECT_FALSE(inputs.Find("args.swiglu")->as_bool());
  EXPECT_EQ(inputs.Find("args.pp_partition_method")->as_string(), "type:transformer");
}

TEST(Settings, MalformedKeyIsRefused) {
  for (const char* key : {"", ".x", "args.", "args..x"}) {
    Result<Value> v = SettingsValue({{key, "1"}});
    ASSERT_FALSE(v.ok()) << key;
    EXPECT_NE(v.status().message().find("args.num_attention_heads=16"), std::string::npos);
  }
}

TEST(Settings, ReadValuesThatTheCheckpointLacksAreAccepted) {
  Result<Value> v = SettingsValue({{"num_attention_heads", "4"}, {"swiglu", "false"}});
  ASSERT_TRUE(v.ok());
  // The metadata records swiglu with the same value: no contradiction.
  EXPECT_TRUE(CheckSettings(*v, Rules(), Metadata({{Value::String("swiglu"), Value::Bool(false)}})).ok());
}

TEST(Settings, ValueNoRuleReadsIsRefusedWithWhatIsRead) {
  Result<Value> v = SettingsValue({{"num_heads", "4"}});
  ASSERT_TRUE(v.ok());
  const Status st = CheckSettings(*v, Rules(), Metadata({}));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(),
            "--set args.num_heads: rule set tiny reads no such value (--set gives args.global_batch_size, args.lr, "
            "args.min_lr, "
            "args.num_attention_heads, args.swiglu, universal_checkpoint_info.original_vocab_size)");
}

// The run's learning-rate schedule, which no rule reads but the Megatron
// exports write; a number is compared as a number.
TEST(Settings, TheRunsLearningRateScheduleIsAccepted) {
  Result<Value> v = SettingsValue({{"lr", "1e-4"}, {"min_lr", "0"}});
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(CheckSettings(*v, Rules(), Metadata({{Value::String("lr"), Value::Float(0.0001)}})).ok());
  const Status st = CheckSettings(*v, Rules(), Metadata({{Value::String("min_lr"), Value::Float(1e-5)}}));
  EXPECT_EQ(st.message(),
            "--set args.min_lr=0 contradicts the checkpoint, which records args.min_lr = 1e-05; drop the --set");
}

TEST(Settings, AMisspeltValueIsRefusedWithTheOneItIsATypoOf) {
  Result<Value> v = SettingsValue({{"num-attention-heads", "4"}});
  ASSERT_TRUE(v.ok());
  const Status st = CheckSettings(*v, Rules(), Metadata({}));
  EXPECT_EQ(st.message(),
            "--set args.num-attention-heads: rule set tiny reads no such value; did you mean "
            "'args.num_attention_heads'?");
}

TEST(Settings, ContradictingTheCheckpointIsRefused) {
  Result<Value> v = SettingsValue({{"num_attention_heads", "8"}});
  ASSERT_TRUE(v.ok());
  const Status st = CheckSettings(*v, Rules(), Metadata({{Value::String("num_attention_heads"), Value::Int(16)}}));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(),
            "--set args.num_attention_heads=8 contradicts the checkpoint, which records "
            "args.num_attention_heads = 16; drop the --set");
}

TEST(Settings, CheckpointsWithoutRulesReadNone) {
  EXPECT_TRUE(RefuseSettings({}).ok());
  EXPECT_FALSE(RefuseSettings({{"num_attention_heads", "4"}}).ok());
}

// An enum member as the two pickle forms give it.
Value EnumMember(const char* how) {
  Object o;
  if (std::string(how) == "name") {
    o.cls = {"builtins", "getattr"};
    o.args = {Value::MakeGlobal({"megatron.enums", "PositionEmbeddingType"}), Value::String("alibi")};
  } else {
    o.cls = {"megatron.enums", "PositionEmbeddingType"};
    o.args = {Value::Int(3)};
  }
  return Value::MakeObject(std::move(o));
}

TEST(Settings, ArgConditionsReadEnumsAndAlternatives) {
  Value metadata = Value::MakeDict(), settings = Value::MakeDict();
  Set(metadata, "args", Value::MakeDict());
  const RuleInputs inputs{metadata, settings};
  for (const char* how : {"name", "value"}) {
    Set(*FindMutable(metadata, "args"), "position_embedding_type", EnumMember(how));
    EXPECT_TRUE(ArgHolds(inputs, "position_embedding_type", "alibi|3")) << how;
    EXPECT_FALSE(ArgHolds(inputs, "position_embedding_type", "!alibi|3")) << how;
    EXPECT_FALSE(ArgHolds(inputs, "position_embedding_type", "rotary|1")) << how;
  }
  EXPECT_EQ(ScalarText(EnumMember("name")), "alibi");
  EXPECT_EQ(ArgsMismatch(inputs, {{"position_embedding_type", "rotary|1"}, {"swiglu", "!true"}}),
            "args.position_embedding_type is not rotary|1");
  EXPECT_EQ(ArgsMismatch(inputs, {{"swiglu", "!true"}}), "");
}

}  // namespace
}  // namespace reshard
