// The args of a Megatron-LM export: the layout rewritten, values NVIDIA
// Megatron-LM cannot unpickle made plain or dropped, each change noted.
#include "formats/megatron_core/common/megatron_args.h"

#include <gtest/gtest.h>
#include "test_util.h"

namespace reshard {
namespace {

Value Call(Global cls, std::vector<Value> args) {
  Object o;
  o.cls = std::move(cls);
  o.args = std::move(args);
  return Value::MakeObject(std::move(o));
}

// getattr(megatron.enums.PositionEmbeddingType, member), as Python 3.11 pickles it.
Value BigScienceEnum(const std::string& member) {
  return Call({"builtins", "getattr"},
              {Value::MakeGlobal({"megatron.enums", "PositionEmbeddingType"}), Value::String(member)});
}

Value TensorValue() { return MakeOwnedTensor(DType::kFloat32, {2}, std::make_shared<std::vector<uint8_t>>(8)); }

std::vector<std::string> Keys(const Value& v) {
  std::vector<std::string> keys;
  for (const auto& [k, unused] : *DictItems(v)) keys.push_back(k.as_string());
  return keys;
}

const MegatronLayout kLayout{4, 2, 3, 128};

TEST(MegatronArgsTest, TheLayoutIsRewrittenInPlaceOrAdded) {
  std::vector<std::string> notes;
  const Value out = MegatronArgs(MakeNamespace({{Value::String("num_layers"), Value::Int(6)},
                                            {Value::String("tensor_model_parallel_size"), Value::Int(2)},
                                            {Value::String("padded_vocab_size"), Value::Int(112)}}),
                                 kLayout, &notes);
  EXPECT_EQ(Keys(out), (std::vector<std::string>{"num_layers", "tensor_model_parallel_size", "padded_vocab_size",
                                                 "pipeline_model_parallel_size", "data_parallel_size", "world_size"}));
  EXPECT_EQ(Find(out, "tensor_model_parallel_size")->as_int(), 4);
  EXPECT_EQ(Find(out, "pipeline_model_parallel_size")->as_int(), 2);
  EXPECT_EQ(Find(out, "data_parallel_size")->as_int(), 3);
  EXPECT_EQ(Find(out, "world_size")->as_int(), 24);
  EXPECT_EQ(Find(out, "padded_vocab_size")->as_int(), 128);
  EXPECT_EQ(out.as_object().cls.Qualified(), "argparse.Namespace");
}

// The virtual pipeline's size is written where the target has one, and a
// source's own cleared where the target has none; the layers-per-chunk
// flag, which Megatron-LM does not take beside it, is cleared.
TEST(MegatronArgsTest, TheVirtualPipelineIsWrittenOrCleared) {
  std::vector<std::string> notes;
  MegatronLayout layout = kLayout;
  layout.vpp = 2;
  const Value chunked = MegatronArgs(MakeNamespace({{Value::String("num_layers_per_virtual_pipeline_stage"),
                                                     Value::Int(3)}}), layout, &notes);
  EXPECT_EQ(Find(chunked, "virtual_pipeline_model_parallel_size")->as_int(), 2);
  EXPECT_EQ(Find(chunked, "num_virtual_stages_per_pipeline_rank")->as_int(), 2);
  EXPECT_TRUE(Find(chunked, "num_layers_per_virtual_pipeline_stage")->is_none());
  const Value plain = MegatronArgs(chunked, kLayout, &notes);
  EXPECT_TRUE(Find(plain, "virtual_pipeline_model_parallel_size")->is_none());
  EXPECT_TRUE(Find(plain, "num_virtual_stages_per_pipeline_rank")->is_none());
  EXPECT_EQ(Find(MegatronArgs(MakeNamespace({}), kLayout, &notes), "virtual_pipeline_model_parallel_size"), nullptr);
}

// A run whose args do not say whether the head is tied gets the model's
// answer written, so a reader does not take it for the other model; without
// rules to say it the field is left as it was.
TEST(MegatronArgsTest, TheTyingOfTheModelIsWritten) {
  for (const bool tied : {false, true}) {
    std::vector<std::string> notes;
    MegatronLayout layout = kLayout;
    layout.tied_embedding = tied;
    const Value out = MegatronArgs(MakeNamespace({}), layout, &notes);
    ASSERT_NE(Find(out, "untie_embeddings_and_output_weights"), nullptr);
    EXPECT_EQ(Find(out, "untie_embeddings_and_output_weights")->as_bool(), !tied);
    EXPECT_NE(notes.front().find(std::string("untie_embeddings_and_output_weights=") + (tied ? "False" : "True")),
              std::string::npos) << notes.front();
  }
  std::vector<std::string> notes;
  EXPECT_EQ(Find(MegatronArgs(MakeNamespace({}), kLayout, &notes), "untie_embeddings_and_output_weights"), nullptr);
}

TEST(MegatronArgsTest, PlainAndTorchValuesStay) {
  std::vector<std::string> notes;
  Value config = Value::MakeDict({{Value::String("zero_optimization"),
                                   Value::MakeDict({{Value::String("stage"), Value::Int(1)}})}});
  const Value in = MakeNamespace({{Value::String("params_dtype"), Value::MakeGlobal({"torch", "bfloat16"})},
                              {Value::String("deepspeed_config_dict"), config},
                              {Value::String("num_experts"), Value::MakeList({Value::Int(1)})},
                              {Value::String("vocab_file"), Value()}});
  const Value out = MegatronArgs(in, kLayout, &notes);
  EXPECT_EQ(Find(out, "params_dtype")->as_global().Qualified(), "torch.bfloat16");
  EXPECT_EQ(Find(out, "deepspeed_config_dict")->DebugString(), config.DebugString());
  EXPECT_TRUE(Find(out, "num_experts")->is_none());  // the fork's [1]: no experts
  EXPECT_TRUE(Find(out, "vocab_file")->is_none());
}

TEST(MegatronArgsTest, TensorsAndForkClassesAreDropped) {
  std::vector<std::string> notes;
  const Value in = MakeNamespace({{Value::String("attn_mask"), TensorValue()},
                              {Value::String("rotary_pos_emb"), Value::MakeTuple({TensorValue()})},
                              {Value::String("scaler"), Call({"deepspeed.runtime.fp16.loss_scaler", "LossScaler"}, {})},
                              {Value::String("hidden_size"), Value::Int(16)}});
  const Value out = MegatronArgs(in, kLayout, &notes);
  EXPECT_EQ(Find(out, "attn_mask"), nullptr);
  EXPECT_EQ(Find(out, "rotary_pos_emb"), nullptr);
  EXPECT_EQ(Find(out, "scaler"), nullptr);
  EXPECT_EQ(Find(out, "hidden_size")->as_int(), 16);
  ASSERT_GE(notes.size(), 1u);
  EXPECT_EQ(notes[0], "args: dropped 3 field(s) NVIDIA Megatron-LM cannot unpickle or rebuilds itself (tensors, "
                      "fork-only classes): attn_mask, rotary_pos_emb, scaler");
}

TEST(MegatronArgsTest, BigSciencePositionTypesBecomeMegatronLmStrings) {
  struct Case {
    Value type;
    const char* want;
  };
  const Case cases[] = {
      {BigScienceEnum("alibi"), "alibi"},
      {BigScienceEnum("absolute"), "learned_absolute"},
      {BigScienceEnum("rotary"), "rope"},
      // EnumClass(value), as Python < 3.11 pickled BLOOM's args: rotary = 1.
      {Call({"megatron.enums", "PositionEmbeddingType"}, {Value::Int(1)}), "rope"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> notes;
    const Value args = MakeNamespace({{Value::String("position_embedding_type"), c.type}});
    const Value out = MegatronArgs(args, kLayout, &notes);
    EXPECT_EQ(Find(out, "position_embedding_type")->as_string(), c.want);
    // Megatron-LM's own value: its legacy model builds positions from the type.
    EXPECT_TRUE(Find(out, "add_position_embedding")->as_bool());
    ASSERT_GE(notes.size(), 1u);
    EXPECT_EQ(notes[0], std::string("args: fork-only values made plain for Megatron-LM: position_embedding_type='") +
                            c.want + "'");
  }
}

// Microsoft's fork's Llama-style args, as Megatron-LM's --use-checkpoint-args reads them.
TEST(MegatronArgsTest, MicrosoftArchitectureAsMegatronLmReadsIt) {
  std::vector<std::string> notes;
  const Value out = MegatronArgs(
      MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                     {Value::String("num_key_value_heads"), Value::Int(4)},
                     {Value::String("normalization"), Value::String("rmsnorm")},
                     {Value::String("num_experts"), Value::MakeList({Value::Int(1)})},
                     {Value::String("use_rotary_position_embeddings"), Value::Bool(true)},
                     {Value::String("add_position_embedding"), Value::Bool(false)},
                     {Value::String("rope_theta"), Value::Float(500000.0)},
                     {Value::String("swiglu"), Value::Bool(true)},
                     {Value::String("untie_embeddings_and_output_weights"), Value::Bool(true)},
                     {Value::String("add_bias_linear"), Value::Bool(false)}}),
      kLayout, &notes);
  EXPECT_TRUE(Find(out, "num_experts")->is_none());
  EXPECT_EQ(Find(out, "normalization")->as_string(), "RMSNorm");
  EXPECT_TRUE(Find(out, "group_query_attention")->as_bool());
  EXPECT_EQ(Find(out, "num_query_groups")->as_int(), 4);
  EXPECT_EQ(Find(out, "position_embedding_type")->as_string(), "rope");
  EXPECT_TRUE(Find(out, "add_position_embedding")->as_bool());
  EXPECT_EQ(Find(out, "rotary_base")->as_int(), 500000);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("num_experts=None"), std::string::npos) << notes[0];
  EXPECT_EQ(notes[1], "megatron: load with --use-checkpoint-args, or give the architecture on the command line: "
                      "--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention "
                      "--num-query-groups 4 --untie-embeddings-and-output-weights --disable-bias-linear "
                      "--rotary-base 500000");
}

// Megatron-Core's Llama 3 RoPE scaling and Qwen2's QKV-only bias, as an HF
// import records them, are flags of their own.
TEST(MegatronArgsTest, RopeScalingAndQkvBiasFlags) {
  std::vector<std::string> notes;
  MegatronArgs(MakeNamespace({{Value::String("add_bias_linear"), Value::Bool(false)},
                              {Value::String("add_qkv_bias"), Value::Bool(true)},
                              {Value::String("use_rope_scaling"), Value::Bool(true)},
                              {Value::String("rope_scaling_factor"), Value::Float(32.0)},
                              {Value::String("rotary_base"), Value::Int(10000)}}),
               kLayout, &notes);
  ASSERT_FALSE(notes.empty());
  EXPECT_EQ(notes.back(), "megatron: load with --use-checkpoint-args, or give the architecture on the command line: "
                          "--disable-bias-linear --add-qkv-bias --use-rope-scaling --rope-scaling-factor 32.0");
}

TEST(MegatronArgsTest, MultiHeadAttentionHasNoQueryGroups) {
  std::vector<std::string> notes;
  const Value out = MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                                                {Value::String("num_key_value_heads"), Value::Int(12)},
                                                {Value::String("normalization"), Value::String("layernorm")},
                                                {Value::String("add_position_embedding"), Value::Bool(true)}}),
                                 kLayout, &notes);
  EXPECT_FALSE(Find(out, "group_query_attention")->as_bool());
  EXPECT_TRUE(Find(out, "num_query_groups")->is_none());
  EXPECT_EQ(Find(out, "normalization")->as_string(), "LayerNorm");
  ASSERT_NE(Find(out, "position_embedding_type"), nullptr);
  EXPECT_EQ(Find(out, "position_embedding_type")->as_string(), "learned_absolute");
}

// Args that already say group_query_attention (an import's, a fork's that
// records Megatron-LM's flag beside num_key_value_heads) get the groups it
// needs; the flags never name a group count the args do not hold.
TEST(MegatronArgsTest, GroupQueryAttentionAlreadySaidGetsItsGroups) {
  std::vector<std::string> notes;
  const Value out = MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                                                {Value::String("num_key_value_heads"), Value::Int(4)},
                                                {Value::String("group_query_attention"), Value::Bool(true)}}),
                                 kLayout, &notes);
  EXPECT_TRUE(Find(out, "group_query_attention")->as_bool());
  ASSERT_NE(Find(out, "num_query_groups"), nullptr);
  EXPECT_EQ(Find(out, "num_query_groups")->as_int(), 4);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes[0], "args: the architecture written as NVIDIA Megatron-LM's --use-checkpoint-args reads it: "
                      "num_query_groups=4");
  EXPECT_EQ(notes[1], "megatron: load with --use-checkpoint-args, or give the architecture on the command line: "
                      "--group-query-attention --num-query-groups 4");
  // A flag that contradicts the weights' groups is the weights'.
  notes.clear();
  const Value contradicting = MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                                                          {Value::String("num_key_value_heads"), Value::Int(4)},
                                                          {Value::String("group_query_attention"), Value::Bool(false)}}),
                                           kLayout, &notes);
  EXPECT_TRUE(Find(contradicting, "group_query_attention")->as_bool());
  EXPECT_EQ(Find(contradicting, "num_query_groups")->as_int(), 4);
  // No group count anywhere: no flag naming one.
  notes.clear();
  MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                              {Value::String("group_query_attention"), Value::Bool(true)}}),
               kLayout, &notes);
  ASSERT_FALSE(notes.empty());
  EXPECT_EQ(notes.back().find("--num-query-groups"), std::string::npos) << notes.back();
}

TEST(MegatronArgsTest, TheGroupsTheModelWasReadWithAreWritten) {
  // Args that leave num_key_value_heads None beside group_query_attention
  // (the groups given by --set): the count the model was read with.
  std::vector<std::string> notes;
  MegatronLayout layout = kLayout;
  layout.kv_groups = 6;
  const Value out = MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                                                {Value::String("num_key_value_heads"), Value::None()},
                                                {Value::String("group_query_attention"), Value::Bool(true)}}),
                                 layout, &notes);
  EXPECT_TRUE(Find(out, "group_query_attention")->as_bool());
  EXPECT_EQ(Find(out, "num_query_groups")->as_int(), 6);
  EXPECT_NE(notes.back().find("--group-query-attention --num-query-groups 6"), std::string::npos) << notes.back();
  EXPECT_EQ(KvGroups(Value::MakeDict({{Value::String("args"), out}}),
                     Value::MakeDict({{Value::String("args"),
                                       MakeNamespace({{Value::String("num_key_value_heads"), Value::Int(6)}})}})),
            6);
  // A count of 0 is no count: no flag suggests it.
  notes.clear();
  MegatronArgs(MakeNamespace({{Value::String("num_attention_heads"), Value::Int(12)},
                              {Value::String("num_query_groups"), Value::Int(0)},
                              {Value::String("group_query_attention"), Value::Bool(true)}}),
               kLayout, &notes);
  EXPECT_EQ(notes.back().find("--num-query-groups"), std::string::npos) << notes.back();
}

TEST(MegatronArgsTest, OtherForkEnumsBecomeTheirMemberNames) {
  std::vector<std::string> notes;
  const Value mask = Call({"builtins", "getattr"},
                          {Value::MakeGlobal({"megatron.enums", "AttnMaskType"}), Value::String("causal")});
  const Value out = MegatronArgs(MakeNamespace({{Value::String("attn_mask_type"), mask}}), kLayout, &notes);
  EXPECT_EQ(Find(out, "attn_mask_type")->as_string(), "causal");
}

TEST(MegatronArgsTest, AnEnumValueWhoseMemberIsUnknownIsDropped) {
  std::vector<std::string> notes;
  const Value unknown = Call({"megatron.enums", "PositionEmbeddingType"}, {Value::Int(9)});
  const Value out = MegatronArgs(MakeNamespace({{Value::String("position_embedding_type"), unknown}}), kLayout, &notes);
  EXPECT_NE(notes[0].find("dropped 1 field(s)"), std::string::npos) << notes[0];
}

}  // namespace
}  // namespace reshard
