// The args of a Megatron-LM export: the layout rewritten, values NVIDIA
// Megatron-LM cannot unpickle made plain or dropped, each change noted.
#include "formats/megatron/megatron_args.h"

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
  EXPECT_TRUE(notes.empty());
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
  EXPECT_EQ(Find(out, "num_experts")->as_list().items.size(), 1u);
  EXPECT_TRUE(Find(out, "vocab_file")->is_none());
  EXPECT_TRUE(notes.empty());
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
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "args: dropped 3 field(s) NVIDIA Megatron-LM cannot unpickle or rebuilds itself (tensors, "
                      "fork-only classes): attn_mask, rotary_pos_emb, scaler");
}

TEST(MegatronArgsTest, BigSciencePositionTypesBecomeMegatronLmStrings) {
  struct Case {
    Value type;
    const char* want;
    bool add_position_embedding;
  };
  const Case cases[] = {
      {BigScienceEnum("alibi"), "alibi", false},
      {BigScienceEnum("absolute"), "learned_absolute", true},
      {BigScienceEnum("rotary"), "rope", false},
      // EnumClass(value), as Python < 3.11 pickled BLOOM's args: rotary = 1.
      {Call({"megatron.enums", "PositionEmbeddingType"}, {Value::Int(1)}), "rope", false},
  };
  for (const Case& c : cases) {
    std::vector<std::string> notes;
    const Value args = MakeNamespace({{Value::String("position_embedding_type"), c.type}});
    const Value out = MegatronArgs(args, kLayout, &notes);
    EXPECT_EQ(Find(out, "position_embedding_type")->as_string(), c.want);
    EXPECT_EQ(Find(out, "add_position_embedding")->as_bool(), c.add_position_embedding);
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_EQ(notes[0], std::string("args: fork-only values made plain for Megatron-LM: position_embedding_type='") +
                            c.want + "', add_position_embedding=" + (c.add_position_embedding ? "True" : "False"));
  }
}

TEST(MegatronArgsTest, ARecordedAddPositionEmbeddingIsKept) {
  std::vector<std::string> notes;
  const Value out = MegatronArgs(MakeNamespace({{Value::String("position_embedding_type"), BigScienceEnum("rotary")},
                                            {Value::String("add_position_embedding"), Value::Bool(true)}}),
                                 kLayout, &notes);
  EXPECT_TRUE(Find(out, "add_position_embedding")->as_bool());
}

TEST(MegatronArgsTest, OtherForkEnumsBecomeTheirMemberNames) {
  std::vector<std::string> notes;
  const Value mask = Call({"builtins", "getattr"},
                          {Value::MakeGlobal({"megatron.enums", "AttnMaskType"}), Value::String("causal")});
  const Value out = MegatronArgs(MakeNamespace({{Value::String("attn_mask_type"), mask}}), kLayout, &notes);
  EXPECT_EQ(Find(out, "attn_mask_type")->as_string(), "causal");
  EXPECT_EQ(Find(out, "add_position_embedding"), nullptr);
}

TEST(MegatronArgsTest, AnEnumValueWhoseMemberIsUnknownIsDropped) {
  std::vector<std::string> notes;
  const Value unknown = Call({"megatron.enums", "PositionEmbeddingType"}, {Value::Int(9)});
  const Value out = MegatronArgs(MakeNamespace({{Value::String("position_embedding_type"), unknown}}), kLayout, &notes);
  EXPECT_EQ(Find(out, "position_embedding_type"), nullptr);
  ASSERT_EQ(notes.size(), 1u);
}

}  // namespace
}  // namespace reshard
