// config.json of the HF export: each field from the metadata, --set, a
// literal fallback or the case that holds; a missing value is asked for.
#include "formats/hf_common/hf_config.h"

#include <gtest/gtest.h>

#include "formats/hf_common/hf_rules.h"
#include "pickle/value.h"

namespace reshard {
namespace {

class HfConfigTest : public ::testing::Test {
 protected:
  HfConfigTest() {
    Set(metadata_, "args", Value::MakeDict());
    Set(settings_, "args", Value::MakeDict());
  }
  void Arg(Value* root, const std::string& name, Value v) { Set(*FindMutable(*root, "args"), name, std::move(v)); }

  static HfConfigField Path(const std::string& key, std::vector<std::string> paths, const Value* literal = nullptr) {
    HfConfigField f;
    f.key = key;
    f.paths = std::move(paths);
    if (literal != nullptr) f.literal = std::make_shared<const Value>(*literal);
    return f;
  }

  static HfConfigField Activation() {
    HfConfigField f;
    f.key = "activation_function";
    f.line = 7;
    f.cases = {{{{"openai_gelu", "true"}}, std::make_shared<const Value>(Value::String("gelu_new")), {}, ""},
               {{{"bias_gelu_fusion", "true"}}, std::make_shared<const Value>(Value::String("gelu_new")), {}, ""},
               {{{"bias_gelu_fusion", "false"}}, std::make_shared<const Value>(Value::String("gelu")), {}, ""}};
    return f;
  }

  Result<Value> Get(const HfConfigField& f) { return HfConfigValue(f, RuleInputs{metadata_, settings_}); }

  Value metadata_ = Value::MakeDict(), settings_ = Value::MakeDict();
};

TEST_F(HfConfigTest, FirstRecordedPathThenSettingsThenFallback) {
  const Value fallback = Value::Float(10000.0);
  const HfConfigField theta = Path("rope_theta", {"args.rope_theta"}, &fallback);
  EXPECT_EQ(Get(theta)->as_float(), 10000.0);
  Arg(&settings_, "rope_theta", Value::Int(500000));
  EXPECT_EQ(Get(theta)->as_int(), 500000);
  Arg(&metadata_, "rope_theta", Value::Int(1000000));
  EXPECT_EQ(Get(theta)->as_int(), 1000000);
}

TEST_F(HfConfigTest, AMissingValueIsAskedFor) {
  Result<Value> v = Get(Path("rms_norm_eps", {"args.layernorm_epsilon"}));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().message(), "config.json rms_norm_eps is args.layernorm_epsilon, which the checkpoint does "
                                  "not record; give it with --set layernorm_epsilon=VALUE");
}

TEST_F(HfConfigTest, TheFirstCaseThatHolds) {
  Arg(&metadata_, "bias_gelu_fusion", Value::Bool(true));
  Arg(&metadata_, "openai_gelu", Value::Bool(false));
  EXPECT_EQ(Get(Activation())->as_string(), "gelu_new");
  Arg(&metadata_, "bias_gelu_fusion", Value::Bool(false));
  EXPECT_EQ(Get(Activation())->as_string(), "gelu");
  Arg(&metadata_, "openai_gelu", Value::Bool(true));
  EXPECT_EQ(Get(Activation())->as_string(), "gelu_new");
}

TEST_F(HfConfigTest, NoCaseHolding) {
  Result<Value> v = Get(Activation());
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("config.json activation_function depends on args.bias_gelu_fusion, "
                                      "args.openai_gelu (hf.config line 7)"),
            std::string::npos);
}

// Llama 3's rope_scaling as Megatron-Core computes it: a mapping whose factor
// is read from the args (Megatron's default 8 when they do not record it).
TEST_F(HfConfigTest, AMappingCaseReadsItsEntries) {
  HfConfigField scaling;
  scaling.key = "rope_scaling";
  const Value factor_default = Value::Float(8.0), original = Value::Int(8192);
  HfConfigField::Case scaled{{{"use_rope_scaling", "true"}}, nullptr, {}, ""};
  scaled.entries = {Path("factor", {"args.rope_scaling_factor"}, &factor_default),
                    Path("original_max_position_embeddings", {}, &original)};
  scaling.cases = {scaled, {{{"use_rope_scaling", "!true"}}, std::make_shared<const Value>(Value::None()), {}, ""}};
  HfExport hf;
  hf.architecture = "LlamaForCausalLM";
  hf.config = {scaling};
  auto json = [&] { return *HfConfigJson(hf, RuleInputs{metadata_, settings_}, 100, DType::kBFloat16); };
  EXPECT_NE(json().find("\"rope_scaling\": null"), std::string::npos) << json();
  Arg(&metadata_, "use_rope_scaling", Value::Bool(true));
  EXPECT_NE(json().find("\"rope_scaling\": {\"factor\": 8.0, \"original_max_position_embeddings\": 8192}"),
            std::string::npos) << json();
  Arg(&metadata_, "rope_scaling_factor", Value::Float(32.0));
  EXPECT_NE(json().find("\"rope_scaling\": {\"factor\": 32.0, "), std::string::npos) << json();
}

TEST_F(HfConfigTest, TheFile) {
  HfExport hf;
  hf.architecture = "LlamaForCausalLM";
  const Value none = Value::None(), no = Value::Bool(false);
  hf.config = {Path("hidden_size", {"args.hidden_size"}), Path("rms_norm_eps", {"args.layernorm_epsilon"}),
               Path("rope_scaling", {}, &none), Path("tie_word_embeddings", {}, &no)};
  Arg(&metadata_, "hidden_size", Value::Int(48));
  Arg(&metadata_, "layernorm_epsilon", Value::Float(1e-5));
  Result<std::string> json = HfConfigJson(hf, RuleInputs{metadata_, settings_}, 100, DType::kBFloat16);
  ASSERT_TRUE(json.ok()) << json.status().message();
  EXPECT_EQ(*json, "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"hidden_size\": 48,\n"
                   "  \"rms_norm_eps\": 1e-05,\n  \"rope_scaling\": null,\n  \"tie_word_embeddings\": false,\n"
                   "  \"vocab_size\": 100,\n  \"torch_dtype\": \"bfloat16\"\n}\n");
  Arg(&metadata_, "hidden_size", Value::MakeList({}));
  EXPECT_NE(HfConfigJson(hf, RuleInputs{metadata_, settings_}, 100, DType::kBFloat16).status().message().find(
                "config.json hidden_size is [], not a number, boolean or string"),
            std::string::npos);
}

TEST_F(HfConfigTest, KeepsTheSourcesFieldsAndAddsTokenIds) {
  HfExport hf;
  hf.architecture = "LlamaForCausalLM";
  hf.config = {Path("hidden_size", {"args.hidden_size"})};
  Arg(&metadata_, "hidden_size", Value::Int(48));
  // The source's order and fields; the ones the export writes replace their values in place.
  const Value source = Value::MakeDict(
      {{Value::String("bos_token_id"), Value::Int(1)},
       {Value::String("hidden_size"), Value::Int(7)},
       {Value::String("task_specific_params"),
        Value::MakeDict({{Value::String("max_length"), Value::MakeList({Value::Int(50)})}})},
       {Value::String("use_cache"), Value::Bool(true)}});
  HfConfigExtras extras{&source, {{"bos_token_id", 9}, {"eos_token_id", 2}}};
  Result<std::string> json = HfConfigJson(hf, RuleInputs{metadata_, settings_}, 100, DType::kBFloat16, extras);
  ASSERT_TRUE(json.ok()) << json.status().message();
  EXPECT_EQ(*json, "{\n  \"bos_token_id\": 1,\n  \"hidden_size\": 48,\n"
                   "  \"task_specific_params\": {\"max_length\": [50]},\n  \"use_cache\": true,\n"
                   "  \"architectures\": [\"LlamaForCausalLM\"],\n  \"vocab_size\": 100,\n"
                   "  \"torch_dtype\": \"bfloat16\",\n  \"eos_token_id\": 2\n}\n");
}

}  // namespace
}  // namespace reshard
