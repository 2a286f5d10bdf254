#include "rules/rule_set.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "formats/hf_common/hf_rules.h"
#include "formats/hf_common/torchtitan_rules.h"
#include "formats/megatron_core/common/torch_dist_rules.h"
#include "pickle/value.h"
#include "rules/builtin_rules.h"
#include "test_util.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// A directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "rule_set_test.XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_; }
  std::string Write(const std::string& name, const std::string& text) const {
    std::string file = path_ + "/" + name;
    std::ofstream(file) << text;
    return file;
  }

 private:
  std::string path_;
};

// Sets an environment variable for one test and restores it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A small valid rule file; tests replace numbered lines to break it.
const char* const kTiny[] = {
    /*  1 */ "name: tiny",
    /*  2 */ "pipeline:",
    /*  3 */ "  specs:",
    /*  4 */ "    - function: _to_float16",
    /*  5 */ "    - embedding: EmbeddingPipe",
    /*  6 */ "    - block: ParallelTransformerLayerPipe",
    /*  7 */ "    - final_norm: LayerNorm",
    /*  8 */ "    - tied_head: EmbeddingPipe",
    /*  9 */ "  tied_module: embed",
    /* 10 */ "vocab: {original_size: 100, divisible_by: 8}",
    /* 11 */ "optimizer_groups: decay_no_decay",
    /* 12 */ "layers:",
    /* 13 */ "  embedding:",
    /* 14 */ "    - {key: 'word_embeddings\\.weight', split: vocab, tied: true}",
    /* 15 */ "  block:",
    /* 16 */ "    - {key: 'attn\\.qkv\\.weight', split: {dim: 0, blocks: args.num_attention_heads}}",
    /* 17 */ "    - {key: 'attn\\.dense\\.weight', split: row}",
    /* 18 */ "    - {key: 'norm\\.(weight|bias)', replicated: true}",
    /* 19 */ "  final_norm:",
    /* 20 */ "    - {key: 'weight', replicated: {drift: average}}",
};

// kTiny with line n (1-based) replaced by `edits[n]`; lines past the end are appended.
std::string Tiny(const std::map<int, std::string>& edits = {}) {
  std::string out;
  int n = 1;
  for (const char* line : kTiny) {
    auto it = edits.find(n++);
    out += (it == edits.end() ? std::string(line) : it->second) + "\n";
  }
  for (auto it = edits.lower_bound(n); it != edits.end(); ++it) out += it->second + "\n";
  return out;
}

std::string ErrorOf(const std::string& yaml) {
  Result<RuleSet> rs = RuleSet::LoadString(yaml, "t.yaml");
  if (rs.ok()) {
    ADD_FAILURE() << "expected an error for:\n" << yaml;
    return "";
  }
  EXPECT_EQ(rs.status().code(), Status::Code::kRuleError);
  return rs.status().message();
}

// ---- parsing -----------------------------------------------------------------

TEST(RuleSetParse, TinyFileLoads) {
  Result<RuleSet> rs = RuleSet::LoadString(Tiny(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  EXPECT_EQ(rs->name(), "tiny");
  EXPECT_EQ(rs->origin(), "t.yaml");
  ASSERT_EQ(rs->numberings().count("default"), 1u);
  const std::vector<SpecEntry>& specs = rs->numberings().at("default");
  ASSERT_EQ(specs.size(), 5u);
  EXPECT_EQ(specs[2].role, "block");
  EXPECT_EQ(specs[2].class_name, "ParallelTransformerLayerPipe");
  EXPECT_FALSE(specs[0].OwnsFile());
  EXPECT_FALSE(specs[4].OwnsFile());
  EXPECT_EQ(rs->tied_module(), "embed");
  EXPECT_EQ(rs->partition_method_default(), "type:transformer");
  EXPECT_TRUE(rs->partition_method_arg().empty());
  EXPECT_EQ(rs->vocab_original_size().ToString(), "100");
  EXPECT_EQ(rs->optimizer_groups(), OptimizerGroups::kDecayNoDecay);

  const std::vector<ParamRule>& block = rs->layers().at("block");
  ASSERT_EQ(block.size(), 3u);
  EXPECT_EQ(block[0].line, 16);
  EXPECT_EQ(block[0].role, "block");
  EXPECT_EQ(block[0].Describe(), "split dim 0 (blocks args.num_attention_heads)");
  EXPECT_EQ(block[1].Describe(), "split dim 1");
  EXPECT_EQ(block[2].Describe(), "replicated");
  EXPECT_EQ(rs->layers().at("final_norm")[0].Describe(), "replicated (drift average)");
  const ParamRule& embed = rs->layers().at("embedding")[0];
  EXPECT_EQ(embed.Describe(), "vocab");
  EXPECT_TRUE(embed.tied);
  EXPECT_FALSE(embed.optional);
}

TEST(RuleSetParse, DetectArgsAreCanonicalStrings) {
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{21, "detect:"},
            {22, "  metadata_keys: [universal_checkpoint_info]"},
            {23, "  absent_metadata_keys: [checkpoint_info]"},
            {24, "  args: {swiglu: True, glu_activation: null, embed_layernorm: '*', n: 3, kind: alibi}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const DetectRule& d = rs->detect();
  EXPECT_EQ(d.metadata_keys, std::vector<std::string>{"universal_checkpoint_info"});
  EXPECT_EQ(d.absent_metadata_keys, std::vector<std::string>{"checkpoint_info"});
  std::map<std::string, std::string> want = {{"swiglu", "true"},
                                             {"glu_activation", "null"},
                                             {"embed_layernorm", "*"},
                                             {"n", "3"},
                                             {"kind", "alibi"}};
  EXPECT_EQ(d.args, want);
}

TEST(RuleSetParse, SplitAndReplicatedForms) {
  Result<RuleSet> rs =
      RuleSet::LoadString(Tiny({{17, "    - {key: 'a', split: {dim: 0, parts: 2, blocks: [args.x, 8]}}"},
                                {18,
                                 "    - {key: 'b', split: {vocab: true}}\n"
                                 "    - {key: 'c', split: column, optional: true, buffer: true}\n"
                                 "    - {key: 'd', replicated: {drift: first}}"}}),
                          "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const std::vector<ParamRule>& block = rs->layers().at("block");
  ASSERT_EQ(block.size(), 5u);
  EXPECT_EQ(block[1].Describe(), "split dim 0 (2 parts, blocks [args.x, 8])");
  EXPECT_EQ(block[2].policy, ParamRule::Policy::kVocab);
  EXPECT_EQ(block[3].Describe(), "split dim 0");
  EXPECT_TRUE(block[3].optional);
  EXPECT_TRUE(block[3].buffer);
  EXPECT_EQ(block[4].drift, DriftPolicy::kFirst);
}

TEST(RuleSetParse, NamedNumberingsAndPartitionArg) {
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{3, "  specs:\n    current:"},
            {4,
             "      - embedding: EmbeddingPipe\n      - block: B\n      - final_norm: N\n      - tied_head: "
             "E"},
            {5, "    legacy:"},
            {6, "      - embedding: EmbeddingPipe\n      - function: <lambda>\n      - block: B"},
            {7, "      - final_norm: N\n      - tied_head: E"},
            {8, "  partition_method: {arg: pp_partition_method, default: 'type:transformer|embedding'}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  ASSERT_EQ(rs->numberings().size(), 2u);
  EXPECT_EQ(rs->numberings().at("current").size(), 4u);
  EXPECT_EQ(rs->numberings().at("legacy")[1].class_name, "<lambda>");
  EXPECT_EQ(rs->partition_method_arg().ToString(), "args.pp_partition_method");
  EXPECT_EQ(rs->partition_method_default(), "type:transformer|embedding");
}

// One validation error: the edit that causes it and what the message must say.
struct BadCase {
  const char* what;
  std::map<int, std::string> edits;
  std::vector<std::string> expected;
};

class RuleSetValidation : public ::testing::TestWithParam<BadCase> {};

TEST_P(RuleSetValidation, ReportsFileLineAndFix) {
  std::string message = ErrorOf(Tiny(GetParam().edits));
  for (const std::string& part : GetParam().expected) {
    EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in:\n" << message;
  }
}

// clang-format off: one case per paragraph reads better than packed lines.
const BadCase kBadCases[] = {
    {"top_level_typo",
     {{11, "optimiser_groups: decay_no_decay"}},
     {"t.yaml:11: unknown field 'optimiser_groups' in the top level", "did you mean 'optimizer_groups'?"}},
    {"unknown_top_level_field",
     {{11, "comments: none"}},
     {"t.yaml:11: unknown field 'comments'", "expected one of: name, description, detect"}},
    {"rule_field_typo",
     {{17, "    - {key: 'attn\\.dense\\.weight', spilt: row}"}},
     {"t.yaml:17: unknown field 'spilt' in a layers.block rule; did you mean 'split'?"}},
    {"repeated_field",
     {{17, "    - {key: 'a', key: 'b', split: row}"}},
     {"t.yaml:17: field 'key' appears twice in a layers.block rule"}},
    {"bad_regex",
     {{17, "    - {key: 'attn(', split: row}"}},
     {"t.yaml:17: bad regex 'attn(': missing ): attn("}},
    {"unknown_split",
     {{17, "    - {key: 'a', split: colum}"}},
     {"t.yaml:17: unknown split 'colum'; did you mean 'column'?"}},
    {"both_policies",
     {{17, "    - {key: 'a', split: row, replicated: true}"}},
     {"t.yaml:17: rule 'a' has both split and replicated; keep one"}},
    {"no_policy",
     {{17, "    - {key: 'a', optional: true}"}},
     {"t.yaml:17: rule 'a' has neither split nor replicated", "replicated: true"}},
    {"replicated_false",
     {{17, "    - {key: 'a', replicated: false}"}},
     {"t.yaml:17: replicated: false is not a policy"}},
    {"negative_dim", {{17, "    - {key: 'a', split: {dim: -1}}"}}, {"t.yaml:17: split dim -1 is negative"}},
    {"split_without_dim", {{17, "    - {key: 'a', split: {parts: 2}}"}}, {"t.yaml:17: split needs dim"}},
    {"zero_parts",
     {{17, "    - {key: 'a', split: {dim: 0, parts: 0}}"}},
     {"t.yaml:17: split parts 0 must be at least 1"}},
    {"vocab_on_dim_1",
     {{17, "    - {key: 'a', split: {vocab: true, dim: 1}}"}},
     {"t.yaml:17: split: vocab must be on dim 0", "not dim 1"}},
    {"vocab_with_parts",
     {{17, "    - {key: 'a', split: {vocab: true, parts: 2}}"}},
     {"t.yaml:17: split: vocab takes no parts or blocks"}},
    {"bad_blocks_path",
     {{17, "    - {key: 'a', split: {dim: 1, blocks: 'args.num heads'}}"}},
     {"t.yaml:17: split.blocks 'args.num heads' is neither an integer nor a dotted path"}},
    {"zero_blocks",
     {{17, "    - {key: 'a', split: {dim: 1, blocks: [args.x, 0]}}"}},
     {"t.yaml:17: split.blocks 0 must be positive"}},
    {"bad_flag",
     {{17, "    - {key: 'a', split: row, optional: maybe}"}},
     {"t.yaml:17: optional must be true or false"}},
    {"missing_key", {{17, "    - {split: row}"}}, {"t.yaml:17: rule without 'key'"}},
    {"duplicate_pattern",
     {{18, "    - {key: 'attn\\.dense\\.weight', replicated: true}"}},
     {"t.yaml:18: duplicate key pattern 'attn\\.dense\\.weight' in layers.block (first at line 17); remove "
      "one"}},
    {"layer_role_without_spec",
     {{21, "  pre_norm:"}, {22, "    - {key: 'weight', replicated: true}"}},
     {"t.yaml:21: layers.pre_norm: role 'pre_norm' is in no pipeline spec list",
      "add {pre_norm: ClassName}"}},
    {"rules_for_a_function",
     {{21, "  function:"}, {22, "    - {key: 'weight', replicated: true}"}},
     {"t.yaml:21: layers.function: spec role 'function' owns no layer file"}},
    {"spec_role_without_rules",
     {{4, "    - pre_norm: LayerNorm"}},
     {"t.yaml:4: spec role 'pre_norm' owns layer files but layers has no 'pre_norm' entry"}},
    {"missing_name", {{1, "# no name"}}, {"t.yaml:1: missing 'name'"}},
    {"bad_name", {{1, "name: my rules"}}, {"t.yaml:1: name 'my rules' must be letters"}},
    {"duplicate_block",
     {{4, "    - block: ParallelTransformerLayerPipe"}},
     {"t.yaml:6: spec list 'default' has a second block entry (first at line 4)"}},
    {"no_block", {{6, "    - function: noop"}}, {"spec list 'default' has no block entry"}},
    {"spec_entry_with_two_keys",
     {{4, "    - {function: f, block: B}"}},
     {"t.yaml:4: a spec entry must be a one-key map {role: ClassName}"}},
    {"unknown_drift",
     {{20, "    - {key: 'weight', replicated: {drift: avg}}"}},
     {"t.yaml:20: unknown drift policy 'avg'; use check, average or first"}},
    {"unknown_optimizer_groups",
     {{11, "optimizer_groups: zero"}},
     {"t.yaml:11: unknown optimizer_groups 'zero'; use decay_no_decay", "split_decay"}},
    {"tied_head_without_module", {{9, ""}}, {"t.yaml:8: a tied_head spec needs pipeline.tied_module"}},
    {"tied_rule_without_tied_head",
     {{8, ""}, {9, ""}},
     {"t.yaml:14: rule 'word_embeddings\\.weight' is tied but no spec list has a tied_head entry"}},
    {"vocab_rule_without_sizes",
     {{10, "vocab: {divisible_by: 8}"}},
     {"t.yaml:14: rule 'word_embeddings\\.weight' splits the vocabulary; set vocab.original_size"}},
    {"unknown_partition_method",
     {{9, "  tied_module: embed\n  partition_method: {default: balanced}"}},
     {"t.yaml:10: unknown partition method 'balanced'"}},
    {"detect_args_list",
     {{21, "detect: {args: {swiglu: [1, 2]}}"}},
     {"t.yaml:21: detect.args.swiglu must be a scalar"}},
    {"yaml_syntax", {{16, "    - {key: 'unterminated"}}, {"t.yaml:", "YAML syntax error"}},
    {"name_placeholder_typo",
     {{17, "    - {key: 'attn\\.dense\\.weight', name: 'layers.{blok}.o', split: row}"}},
     {"t.yaml:17: name 'layers.{blok}.o' has an unknown placeholder '{blok}'; did you mean '{block}'?"}},
    {"name_unknown_placeholder",
     {{17, "    - {key: 'attn\\.dense\\.(weight)', name: 'layers.{block}.{tensor}', split: row}"}},
     {"t.yaml:17: name 'layers.{block}.{tensor}' has an unknown placeholder '{tensor}'; "
      "expected one of: {block}, {layer}, {key}, {1}"}},
    {"name_block_outside_block_rules",
     {{20, "    - {key: 'weight', name: 'final.{block}', replicated: true}"}},
     {"t.yaml:20: name 'final.{block}' uses {block} in a layers.final_norm rule", "use {layer}"}},
    {"name_group_beyond_the_key",
     {{18, "    - {key: 'norm\\.(weight|bias)', name: 'layers.{block}.norm.{2}', replicated: true}"}},
     {"t.yaml:18: name 'layers.{block}.norm.{2}' uses {2} but key 'norm\\.(weight|bias)' has 1 capture "
      "group;"}},
    {"name_group_without_groups",
     {{20, "    - {key: 'weight', name: 'final.{1}', replicated: true}"}},
     {"t.yaml:20: name 'final.{1}' uses {1} but key 'weight' has 0 capture groups"}},
    {"name_group_zero",
     {{20, "    - {key: 'weight', name: 'final.{0}', replicated: true}"}},
     {"t.yaml:20: name 'final.{0}': {0} is not a capture group", "{key} is the whole key"}},
    {"name_unclosed_brace",
     {{17, "    - {key: 'attn\\.dense\\.weight', name: 'layers.{block.o', split: row}"}},
     {"t.yaml:17: name 'layers.{block.o': the '{' at character 8 has no matching '}'; "
      "placeholders are {block}, {layer}, {key}"}},
    {"name_nested_brace",
     {{17, "    - {key: 'attn\\.dense\\.weight', name: 'layers.{b{block}', split: row}"}},
     {"t.yaml:17: name 'layers.{b{block}': the '{' at character 8 has no matching '}'"}},
    {"name_unopened_brace",
     {{20, "    - {key: 'weight', name: 'final}.weight', replicated: true}"}},
     {"t.yaml:20: name 'final}.weight': the '}' at character 6 has no matching '{'"}},
    {"name_unquoted_placeholder",
     {{20, "    - {key: 'weight', name: {key}, replicated: true}"}},
     {"t.yaml:20: name must be a non-empty string; quote a template that starts with '{'"}},
    {"name_empty",
     {{20, "    - {key: 'weight', name: '', replicated: true}"}},
     {"t.yaml:20: name must be a non-empty string"}},
    {"name_same_in_every_block",
     {{17, "    - {key: 'attn\\.dense\\.weight', name: 'attn.o.weight', split: row}"}},
     {"t.yaml:17: name 'attn.o.weight' is the same in every block; add {block}, e.g. "
      "layers.{block}.attn.o.weight"}},
    {"name_fixed_twice_in_a_role",
     {{17, "    - {key: 'attn\\.dense\\.weight', name: 'layers.{block}.o', split: row}"},
      {18, "    - {key: 'norm\\.(weight|bias)', name: 'layers.{block}.o', replicated: true}"}},
     {"t.yaml:18: rules at lines 17 and 18 both name their tensors 'layers.{block}.o'; give each its own "
      "name or add {key}"}},
    {"name_fixed_twice_across_roles",
     {{14, "    - {key: 'word_embeddings\\.weight', name: 'w', split: vocab, tied: true}"},
      {20, "    - {key: 'weight', name: 'w', replicated: true}"}},
     {"t.yaml:20: rules at lines 14 and 20 both name their tensors 'w'"}},
    {"expert_group_out_of_range",
     {{17, "    - {key: 'experts\\.(\\d+)\\.w', name: 'layers.{block}.e.{1}', replicated: true, expert: 2}"}},
     {"t.yaml:17: expert: 2 is not a capture group of key 'experts\\.(\\d+)\\.w' (it has 1)"}},
    {"expert_name_without_the_id",
     {{17, "    - {key: 'experts\\.(\\d+)\\.w', name: 'layers.{block}.e', replicated: true, expert: 1}"}},
     {"t.yaml:17: name 'layers.{block}.e' of an expert rule must hold the expert id {1}"}},
    {"expert_in_dense_blocks",
     {{17, "    - {key: 'experts\\.(\\d+)\\.w', replicated: true, moe: false, expert: 1}"}},
     {"t.yaml:17: an expert rule is in MoE blocks only; remove moe: false"}},
    {"moe_not_a_bool",
     {{17, "    - {key: 'gate', replicated: true, moe: maybe}"}},
     {"t.yaml:17: moe must be true or false"}},
    {"module_path_block_without_its_number",
     {{21, "module_paths: {block: 'model\\.layers\\.\\d+\\.'}"}},
     {"t.yaml:21: module_paths.block 'model\\.layers\\.\\d+\\.' must have one capture group, the block number"}},
    {"module_path_of_a_role_without_rules",
     {{21, "module_paths: {head: 'lm_head\\.'}"}},
     {"t.yaml:21: module_paths.head: no layers.head rules describe its tensors"}},
};
// clang-format on

INSTANTIATE_TEST_SUITE_P(RuleSetErrors, RuleSetValidation, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.what; });

TEST(RuleSetParse, TopLevelMustBeAMapping) {
  EXPECT_NE(ErrorOf("- a\n- b\n").find("t.yaml:1: the top level of a rule file must be a mapping"),
            std::string::npos);
}

TEST(RuleSetParse, ReportsEveryErrorOnItsOwnLine) {
  std::string message =
      ErrorOf(Tiny({{11, "optimizer_groups: zero"}, {17, "    - {key: 'a(', split: row}"}}));
  EXPECT_NE(message.find("t.yaml:11: unknown optimizer_groups"), std::string::npos) << message;
  EXPECT_NE(message.find("\nt.yaml:17: bad regex"), std::string::npos) << message;
}

// ---- matching ----------------------------------------------------------------

TEST(RuleSetMatch, FindsTheOneRuleThatFullyMatches) {
  Result<RuleSet> rs = RuleSet::LoadString(Tiny(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  Result<const ParamRule*> rule = rs->Match("block", "norm.bias");
  ASSERT_TRUE(rule.ok());
  ASSERT_NE(*rule, nullptr);
  EXPECT_EQ((*rule)->line, 18);

  // Full match: a key that only contains a pattern does not match it.
  Result<const ParamRule*> partial = rs->Match("block", "x.norm.weight");
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(*partial, nullptr);

  Result<const ParamRule*> unknown_role = rs->Match("head", "lm_head.weight");
  ASSERT_TRUE(unknown_role.ok());
  EXPECT_EQ(*unknown_role, nullptr);
}

TEST(RuleSetMatch, AmbiguousKeyNamesBothLines) {
  Result<RuleSet> rs =
      RuleSet::LoadString(Tiny({{18, "    - {key: 'attn\\..*', replicated: true}"}}), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  Result<const ParamRule*> rule = rs->Match("block", "attn.dense.weight");
  ASSERT_FALSE(rule.ok());
  EXPECT_EQ(rule.status().code(), Status::Code::kRuleError);
  EXPECT_EQ(rule.status().message(),
            "t.yaml: key 'attn.dense.weight' in block files matches rules at lines 17 and 18; "
            "make the patterns disjoint");
}

// ---- MoE: the expert axis and module paths -----------------------------------

TEST(RuleSetMoe, ExpertRuleReadsTheGlobalIdFromItsGroup) {
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{17, "    - {key: 'experts\\.(\\d+)\\.(w|b)', name: 'layers.{block}.e.{1}.{2}', replicated: true, "
                 "expert: 1}"},
            {16, "    - {key: 'gate', replicated: true, moe: true}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const ParamRule* expert = *rs->Match("block", "experts.13.b");
  ASSERT_NE(expert, nullptr);
  EXPECT_EQ(expert->ExpertId("experts.13.b"), 13);
  EXPECT_TRUE(expert->MoeOnly());
  EXPECT_EQ(expert->CanonicalName("experts.13.b", 4, 2), "layers.2.e.13.b");
  EXPECT_EQ(expert->WithExpertId("experts.13.b", 1), "experts.1.b");
  EXPECT_EQ(expert->ExpertIdOffset("experts.13.b"), 8u);
  const ParamRule* norm = *rs->Match("block", "norm.weight");
  EXPECT_EQ(norm->ExpertId("norm.weight"), -1);
  EXPECT_FALSE(norm->MoeOnly());
}

TEST(RuleSetMoe, RequiredOnlyInTheBlocksTheRuleIsFor) {
  Result<RuleSet> rs = RuleSet::LoadString(Tiny({{17, "    - {key: 'mlp\\.w', split: row, moe: false}"},
                                                 {16, "    - {key: 'gate', replicated: true, moe: true}"}}),
                                           "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const ParamRule* dense = *rs->Match("block", "mlp.w");
  const ParamRule* gate = *rs->Match("block", "gate");
  const ParamRule* norm = *rs->Match("block", "norm.bias");
  EXPECT_TRUE(dense->RequiredIn(false));
  EXPECT_FALSE(dense->RequiredIn(true));
  EXPECT_TRUE(gate->RequiredIn(true));
  EXPECT_FALSE(gate->RequiredIn(false));
  EXPECT_TRUE(norm->RequiredIn(true));
  EXPECT_TRUE(norm->RequiredIn(false));
}

TEST(RuleSetMoe, ModulePathsNameRoleBlockAndKey) {
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{21, "module_paths:"},
            {22, "  embedding: 'lm\\.embedding\\.'"},
            {23, "  block: 'lm\\.encoder\\.layers\\.(\\d+)\\.'"},
            {24, "  final_norm: 'lm\\.encoder\\.(?:final_norm|ln_f)\\.'"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  std::string role, key;
  int block = 0;
  ASSERT_TRUE(rs->SplitModulePath("lm.encoder.layers.12.attn.dense.weight", &role, &block, &key));
  EXPECT_EQ(role, "block");
  EXPECT_EQ(block, 12);
  EXPECT_EQ(key, "attn.dense.weight");
  ASSERT_TRUE(rs->SplitModulePath("lm.encoder.ln_f.weight", &role, &block, &key));
  EXPECT_EQ(role, "final_norm");
  EXPECT_EQ(block, -1);
  EXPECT_EQ(key, "weight");
  EXPECT_FALSE(rs->SplitModulePath("lm.decoder.layers.0.w", &role, &block, &key));
}

// ---- canonical names ---------------------------------------------------------

TEST(RuleSetNames, EveryPlaceholderExpands) {
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{16, "    - {key: 'attn\\.(q|k)_(w|b)', name: 'layers.{block}.attn.{1}.{2}', split: row}"},
            {17, "    - {key: 'attn\\.dense\\.weight', name: 'file{layer}.block{block}.{key}', split: row}"},
            {18, "    - {key: 'norm(_extra)?\\.weight', name: 'layers.{block}.norm{1}', replicated: true}"},
            {20, "    - {key: 'weight', name: 'final_layernorm.{layer}.{key}', replicated: true}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const std::vector<ParamRule>& block = rs->layers().at("block");
  EXPECT_EQ(block[0].CanonicalName("attn.k_b", 5, 2), "layers.2.attn.k.b");
  EXPECT_EQ(block[0].CanonicalName("attn.q_w", 3, 0), "layers.0.attn.q.w");
  EXPECT_EQ(block[1].CanonicalName("attn.dense.weight", 12, 9), "file12.block9.attn.dense.weight");
  EXPECT_EQ(block[2].CanonicalName("norm_extra.weight", 4, 1), "layers.1.norm_extra");
  EXPECT_EQ(block[2].CanonicalName("norm.weight", 4, 1), "layers.1.norm");  // group took no part
  EXPECT_EQ(rs->layers().at("final_norm")[0].CanonicalName("weight", 7, -1), "final_layernorm.7.weight");
  EXPECT_EQ(block[0].name_template, "layers.{block}.attn.{1}.{2}");
}

TEST(RuleSetNames, DefaultsFollowTheRole) {
  Result<RuleSet> rs = RuleSet::LoadString(Tiny(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const ParamRule& qkv = rs->layers().at("block")[0];
  EXPECT_EQ(qkv.name_template, "layers.{block}.{key}");
  EXPECT_EQ(qkv.CanonicalName("attn.qkv.weight", 4, 2), "layers.2.attn.qkv.weight");
  const ParamRule& embedding = rs->layers().at("embedding")[0];
  EXPECT_EQ(embedding.name_template, "embedding.{key}");
  EXPECT_EQ(embedding.CanonicalName("word_embeddings.weight", 1, -1), "embedding.word_embeddings.weight");
  EXPECT_EQ(rs->layers().at("final_norm")[0].CanonicalName("weight", 5, -1), "final_norm.weight");
}

TEST(RuleSetNames, RepeatsThatNameDifferentTensorsAreAllowed) {
  // {layer} tells the files of two roles apart; {key} and groups the tensors of one.
  Result<RuleSet> rs = RuleSet::LoadString(
      Tiny({{14, "    - {key: 'word_embeddings\\.weight', name: 'stage{layer}', split: vocab, tied: true}"},
            {17, "    - {key: 'attn\\.dense\\.weight', name: 'layers.{block}.{key}', split: row}"},
            {18, "    - {key: 'norm\\.(weight|bias)', name: 'layers.{block}.{key}', replicated: true}"},
            {20, "    - {key: 'weight', name: 'stage{layer}', replicated: true}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  EXPECT_EQ(rs->layers().at("embedding")[0].CanonicalName("word_embeddings.weight", 1, -1), "stage1");
  EXPECT_EQ(rs->layers().at("final_norm")[0].CanonicalName("weight", 5, -1), "stage5");
}

// ---- metadata references -----------------------------------------------------

Value Metadata() {
  Items args = {
      {Value::String("num_attention_heads"), Value::Int(16)},
      {Value::String("num_key_value_heads"), Value::None()},
      {Value::String("pp_partition_method"), Value::String("type:transformer|embedding")},
      {Value::String("swiglu"), Value::Bool(true)},
  };
  Items info = {{Value::String("original_vocab_size"), Value::Int(250680)}};
  return Value::MakeDict({
      {Value::String("args"), MakeNamespace(std::move(args))},
      {Value::String("universal_checkpoint_info"), MakeOrderedDict(std::move(info))},
  });
}

std::optional<int64_t> Resolve(std::vector<std::string> alternatives, const Value& settings = Value::MakeDict()) {
  const Value metadata = Metadata();
  return MetaRef{std::move(alternatives)}.Resolve(RuleInputs{metadata, settings});
}

TEST(RuleSetMetaRef, ResolvesAlternativesInOrder) {
  EXPECT_EQ(Resolve({"args.num_attention_heads"}), 16);
  EXPECT_EQ(Resolve({"args.num_key_value_heads", "args.num_attention_heads"}), 16);  // None: next
  EXPECT_EQ(Resolve({"args.absent", "7"}), 7);
  EXPECT_EQ(Resolve({"12", "args.num_attention_heads"}), 12);
  EXPECT_EQ(Resolve({"universal_checkpoint_info.original_vocab_size"}), 250680);  // OrderedDict
  EXPECT_EQ(Resolve({"args.swiglu"}), 1);
}

TEST(RuleSetMetaRef, UnresolvableGivesNullopt) {
  EXPECT_EQ(Resolve({"args.num_key_value_heads"}), std::nullopt);
  EXPECT_EQ(Resolve({"checkpoint_info.original_vocab_size"}), std::nullopt);
  EXPECT_EQ(Resolve({"args.num_attention_heads.deeper"}), std::nullopt);
  EXPECT_EQ(Resolve({"args.pp_partition_method"}), std::nullopt);  // not an integer
  EXPECT_EQ(Resolve({}), std::nullopt);
}

// Settings (--set) fill in what the metadata does not record, never what it does.
TEST(RuleSetMetaRef, SettingsFillOnlyWhatTheMetadataLacks) {
  const Value settings = Value::MakeDict({{Value::String("args"), Value::MakeDict({
      {Value::String("num_key_value_heads"), Value::Int(4)},
      {Value::String("num_attention_heads"), Value::Int(99)},
  })}});
  EXPECT_EQ(Resolve({"args.num_key_value_heads"}, settings), 4);  // None in the metadata
  EXPECT_EQ(Resolve({"args.num_attention_heads"}, settings), 16);
  EXPECT_EQ(Resolve({"args.num_key_value_heads", "8"}, settings), 4);  // before the fallback
  EXPECT_EQ(Resolve({"args.num_key_value_heads", "8"}), 8);
}

TEST(RuleSetMetaRef, LookupReturnsAnyKind) {
  const Value metadata = Metadata();
  const Value none = Value::MakeDict();
  const RuleInputs inputs{metadata, none};
  const Value* v = MetaRef{{"args.pp_partition_method"}}.Lookup(inputs);
  ASSERT_NE(v, nullptr);
  ASSERT_TRUE(v->is(Value::Kind::kString));
  EXPECT_EQ(v->as_string(), "type:transformer|embedding");
  EXPECT_EQ((MetaRef{{"3", "args.num_key_value_heads"}}.Lookup(inputs)), nullptr);
}

TEST(RuleSetMetaRef, HowToGiveNamesTheRuleFileAndTheCommandLine) {
  EXPECT_EQ((MetaRef{{"args.num_attention_heads", "4"}}.HowToGive()),
            "not recorded in the checkpoint metadata (args.num_attention_heads); give it as a "
            "fallback in the rule file ([args.num_attention_heads, N]) or with --set "
            "args.num_attention_heads=N");
}

TEST(RuleSetMetaRef, ToString) {
  EXPECT_EQ(MetaRef{{"args.num_attention_heads"}}.ToString(), "args.num_attention_heads");
  EXPECT_EQ((MetaRef{{"args.a", "4"}}.ToString()), "[args.a, 4]");
}

TEST(RuleSetDrift, NamesRoundTrip) {
  for (DriftPolicy p : {DriftPolicy::kCheck, DriftPolicy::kAverage, DriftPolicy::kFirst}) {
    EXPECT_EQ(ParseDriftPolicy(DriftPolicyName(p)), p);
  }
  EXPECT_EQ(ParseDriftPolicy("mean"), std::nullopt);
}

// ---- built-in rule sets ------------------------------------------------------

TEST(RuleSetBuiltin, EveryFileLoads) {
  Result<std::vector<RuleSet>> sets = LoadBuiltinRuleSets();
  ASSERT_TRUE(sets.ok()) << sets.status().message();
  std::vector<std::string> names;
  for (const RuleSet& rs : *sets) names.push_back(rs.name());
  // In file-name order: megatron-gpt2-moe.yaml sorts before megatron-gpt2.yaml.
  std::vector<std::string> want = {"bigscience-bloom",  "bigscience-glu",     "megatron-core-gpt", "megatron-core-moe",
                                   "megatron-gpt2-moe", "megatron-gpt2",       "megatron-llama-tied", "megatron-llama",
                                   "mixtral",           "qwen2-moe",           "qwen2-tied",
                                   "qwen2",             "qwen3-moe"};
  EXPECT_EQ(names, want);
}

// The layer-file keys of each family (format reference §5, §18.5), with every
// optional variant; each must match exactly one rule, and every required rule
// must be matched by some key.
struct Inventory {
  const char* rules;
  std::map<std::string, std::vector<std::string>> keys;
};

const std::vector<std::string> kBsBlock = {
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "self_attention.dense.weight",
    "self_attention.dense.bias",
    "self_attention.rotary_emb.inv_freq",
    "post_attention_layernorm.weight",
    "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight",
    "mlp.dense_4h_to_h.bias",
};
const std::vector<std::string> kBsEmbedding = {"word_embeddings.weight", "word_embeddings.norm.weight",
                                               "word_embeddings.norm.bias", "position_embeddings.weight"};

std::vector<std::string> WithoutKey(std::vector<std::string> keys, const std::string& key) {
  keys.erase(std::find(keys.begin(), keys.end(), key));
  return keys;
}

// A dense block's keys and a (residual) MoE block's (megatron-deepspeed-format.md §6.8).
std::vector<std::string> MoeBlockKeys() {
  std::vector<std::string> keys = WithoutKey(kBsBlock, "self_attention.rotary_emb.inv_freq");
  for (const char* key : {"mlp.deepspeed_moe.gate.wg.weight",
                          "mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight",
                          "mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.bias",
                          "mlp.deepspeed_moe.experts.deepspeed_experts.11.dense_4h_to_h.weight",
                          "mlp.deepspeed_moe.experts.deepspeed_experts.11.dense_4h_to_h.bias",
                          "mlp.mlp.dense_h_to_4h.weight", "mlp.mlp.dense_h_to_4h.bias", "mlp.mlp.dense_4h_to_h.weight",
                          "mlp.mlp.dense_4h_to_h.bias", "mlp.coefficient.weight", "mlp.coefficient.bias"}) {
    keys.push_back(key);
  }
  return keys;
}

const Inventory kInventories[] = {
    {"bigscience-bloom",
     {{"embedding", kBsEmbedding}, {"block", kBsBlock}, {"final_norm", {"weight", "bias"}}}},
    {"bigscience-glu",
     {{"embedding", kBsEmbedding}, {"block", kBsBlock}, {"final_norm", {"weight", "bias"}}}},
    {"megatron-gpt2",
     {{"embedding",
       {"word_embeddings.weight", "position_embeddings.weight",
        "position_embeddings.local_embeddings.weight"}},
      {"block", WithoutKey(kBsBlock, "self_attention.rotary_emb.inv_freq")},
      {"final_norm", {"weight", "bias"}}}},
    {"megatron-gpt2-moe",
     {{"embedding", {"word_embeddings.weight", "position_embeddings.weight"}},
      {"block", MoeBlockKeys()},
      {"final_norm", {"weight", "bias"}}}},
    {"megatron-llama",
     {{"embedding", {"word_embeddings.weight"}},
      {"block",
       {"input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.dense.weight",
        "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight"}},
      {"final_norm", {"weight"}},
      {"head", {"lm_head.weight"}}}},
    {"qwen2",
     {{"embedding", {"word_embeddings.weight"}},
      {"block",
       {"input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
        "self_attention.dense.weight", "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight",
        "mlp.dense_4h_to_h.weight"}},
      {"final_norm", {"weight"}},
      {"head", {"lm_head.weight"}}}},
};

TEST(RuleSetBuiltin, RulesExplainTheFamilyKeys) {
  for (const Inventory& inv : kInventories) {
    SCOPED_TRACE(inv.rules);
    Result<RuleSet> rs = LoadRuleSet(inv.rules);
    ASSERT_TRUE(rs.ok()) << rs.status().message();
    std::set<const ParamRule*> used;
    for (const auto& [role, keys] : inv.keys) {
      for (const std::string& key : keys) {
        Result<const ParamRule*> rule = rs->Match(role, key);
        ASSERT_TRUE(rule.ok()) << rule.status().message();
        EXPECT_NE(*rule, nullptr) << role << " key " << key;
        used.insert(*rule);
      }
    }
    for (const auto& [role, rules] : rs->layers()) {
      for (const ParamRule& rule : rules) {
        EXPECT_TRUE(rule.optional || used.count(&rule))
            << role << " rule '" << rule.key_pattern << "' unused";
      }
    }
  }
}

// Describe() of the rule that `key` matches in a built-in rule set.
std::string Layout(const std::string& rules, const std::string& role, const std::string& key) {
  Result<RuleSet> rs = LoadRuleSet(rules);
  if (!rs.ok()) return rs.status().message();
  Result<const ParamRule*> rule = rs->Match(role, key);
  if (!rule.ok()) return rule.status().message();
  return *rule ? (*rule)->Describe() : "no rule";
}

TEST(RuleSetBuiltin, TensorParallelLayouts) {
  EXPECT_EQ(Layout("megatron-gpt2", "block", "self_attention.query_key_value.bias"),
            "split dim 0 (blocks [args.num_key_value_heads, args.num_attention_heads])");
  EXPECT_EQ(Layout("megatron-gpt2", "block", "self_attention.dense.weight"),
            "split dim 1 (blocks args.num_attention_heads)");
  EXPECT_EQ(Layout("megatron-gpt2", "block", "mlp.dense_4h_to_h.bias"), "replicated");
  EXPECT_EQ(Layout("megatron-llama", "block", "self_attention.query_key_value.weight"),
            "split dim 0 (blocks [args.num_key_value_heads, args.num_attention_heads])");
  EXPECT_EQ(Layout("megatron-llama", "block", "mlp.dense_h_to_4h.weight"), "split dim 0 (2 parts)");
  EXPECT_EQ(Layout("megatron-llama", "head", "lm_head.weight"), "vocab");
  EXPECT_EQ(Layout("bigscience-glu", "block", "mlp.dense_h_to_4h.bias"), "split dim 0 (2 parts)");
  EXPECT_EQ(Layout("bigscience-bloom", "block", "mlp.dense_h_to_4h.bias"), "split dim 0");
  EXPECT_EQ(Layout("bigscience-bloom", "block", "self_attention.rotary_emb.inv_freq"),
            "replicated (drift check)");
  EXPECT_EQ(Layout("bigscience-bloom", "embedding", "word_embeddings.norm.weight"), "replicated");
}

// The convention of the built-in files (docs/rules.md, "Canonical names"):
// Megatron's module paths without the language_model(.encoder) prefix.
std::string ConventionalName(const std::string& role, const std::string& key, int block) {
  if (role == "embedding") return "embedding." + key;
  if (role == "block") return "layers." + std::to_string(block) + "." + key;
  if (role == "final_norm") return "final_layernorm." + key;
  return key;  // the untied head: lm_head.weight
}

TEST(RuleSetBuiltin, EveryRuleNamesItsTensorsByTheConvention) {
  for (const Inventory& inv : kInventories) {
    SCOPED_TRACE(inv.rules);
    Result<RuleSet> rs = LoadRuleSet(inv.rules);
    ASSERT_TRUE(rs.ok()) << rs.status().message();
    for (const auto& [role, rules] : rs->layers()) {
      for (const ParamRule& rule : rules) {
        // Written out in the file, not the default built from the key.
        EXPECT_EQ(rule.name_template.find("{key}"), std::string::npos) << rule.key_pattern;
      }
    }
    std::set<std::string> names;
    for (const auto& [role, keys] : inv.keys) {
      const int block = role == "block" ? 3 : -1;
      for (const std::string& key : keys) {
        const ParamRule* rule = rs->Match(role, key).value();
        ASSERT_NE(rule, nullptr) << key;
        std::string name = rule->CanonicalName(key, 5, block);
        EXPECT_EQ(name, ConventionalName(role, key, block)) << role << " key " << key;
        EXPECT_TRUE(names.insert(name).second) << "two tensors named " << name;
      }
    }
  }
}

TEST(RuleSetBuiltin, FamilyFacts) {
  Result<RuleSet> gpt2 = LoadRuleSet("megatron-gpt2");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status().message();
  EXPECT_EQ(gpt2->numberings().size(), 2u);
  EXPECT_EQ(gpt2->numberings().at("current").size(), 6u);
  EXPECT_EQ(gpt2->numberings().at("legacy").size(), 8u);
  EXPECT_EQ(gpt2->tied_module(), "embed");
  EXPECT_EQ(gpt2->detect().args.at("swiglu"), "false");
  EXPECT_TRUE(gpt2->Match("embedding", "position_embeddings.weight").value()->tied);

  Result<RuleSet> moe = LoadRuleSet("megatron-gpt2-moe");
  ASSERT_TRUE(moe.ok()) << moe.status().message();
  EXPECT_EQ(moe->detect().metadata_keys, std::vector<std::string>{"num_experts"});
  const ParamRule* expert =
      moe->Match("block", "mlp.deepspeed_moe.experts.deepspeed_experts.5.dense_h_to_4h.weight").value();
  EXPECT_EQ(expert->ExpertId("mlp.deepspeed_moe.experts.deepspeed_experts.5.dense_h_to_4h.weight"), 5);
  EXPECT_EQ(expert->policy, ParamRule::Policy::kReplicated);  // whole on every TP rank without expert-TP
  EXPECT_TRUE(moe->Match("block", "mlp.deepspeed_moe.gate.wg.weight").value()->MoeOnly());
  EXPECT_FALSE(moe->Match("block", "mlp.dense_h_to_4h.weight").value()->RequiredIn(true));
  std::string role, key;
  int block = -1;
  EXPECT_TRUE(moe->SplitModulePath("language_model.encoder.layers.3.mlp.deepspeed_moe.gate.wg.weight", &role,
                                   &block, &key));
  EXPECT_EQ(role + " " + std::to_string(block) + " " + key, "block 3 mlp.deepspeed_moe.gate.wg.weight");

  Result<RuleSet> bloom = LoadRuleSet("bigscience-bloom");
  ASSERT_TRUE(bloom.ok()) << bloom.status().message();
  EXPECT_EQ(bloom->optimizer_groups(), OptimizerGroups::kSplitDecay);
  EXPECT_EQ(bloom->partition_method_arg().ToString(), "args.pp_partition_method");
  EXPECT_EQ(bloom->vocab_pad_to().ToString(), "args.pad_vocab_size_to");
  EXPECT_EQ(bloom->detect().args.at("glu_activation"), "null");
  EXPECT_FALSE(bloom->Match("embedding", "word_embeddings.norm.bias").value()->tied);
  EXPECT_TRUE(bloom->Match("block", "self_attention.rotary_emb.inv_freq").value()->buffer);

  Result<RuleSet> llama = LoadRuleSet("megatron-llama");
  ASSERT_TRUE(llama.ok()) << llama.status().message();
  EXPECT_TRUE(llama->tied_module().empty());
  EXPECT_FALSE(llama->Match("embedding", "word_embeddings.weight").value()->tied);
  EXPECT_EQ(llama->detect().args.at("swiglu"), "true");
}

TEST(RuleSetBuiltin, LoadByNameAndByPath) {
  Result<RuleSet> by_name = LoadRuleSet("megatron-llama");
  ASSERT_TRUE(by_name.ok()) << by_name.status().message();
  Result<RuleSet> by_path = LoadRuleSet(std::string(RESHARD_SOURCE_DIR) + "/rules/megatron-llama.yaml");
  ASSERT_TRUE(by_path.ok()) << by_path.status().message();
  EXPECT_EQ(by_path->name(), "megatron-llama");

  TempDir dir;
  Result<RuleSet> custom = LoadRuleSet(dir.Write("mine.yaml", Tiny()));
  ASSERT_TRUE(custom.ok()) << custom.status().message();
  EXPECT_EQ(custom->name(), "tiny");
}

TEST(RuleSetBuiltin, UnknownNameListsTheBuiltins) {
  Result<RuleSet> rs = LoadRuleSet("gpt3");
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().code(), Status::Code::kInvalidInput);
  EXPECT_EQ(rs.status().message(),
            "unknown rule set 'gpt3'; built-in: bigscience-bloom, bigscience-glu, megatron-core-gpt, megatron-core-moe, "
            "megatron-gpt2-moe, "
            "megatron-gpt2, megatron-llama-tied, megatron-llama, mixtral, qwen2-moe, qwen2-tied, qwen2, qwen3-moe; or "
            "pass the path of a rule file");
}

TEST(RuleSetBuiltin, AMisspeltNameGetsTheOneItIsATypoOf) {
  Result<RuleSet> rs = LoadRuleSet("megatron-lama");
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().message(), "unknown rule set 'megatron-lama'; did you mean 'megatron-llama'?");
}

TEST(RuleSetBuiltin, MissingFileIsNotTakenForAName) {
  Result<RuleSet> rs = LoadRuleSet("no/such/rules.yaml");
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().message(), "rule file 'no/such/rules.yaml' not found");
}

TEST(RuleSetBuiltin, ErrorsInAFileNameIt) {
  TempDir dir;
  std::string path = dir.Write("bad.yaml", Tiny({{20, "    - {key: 'weight', replicated: {drift: avg}}"}}));
  Result<RuleSet> rs = RuleSet::LoadFile(path);
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().message(), path + ":20: unknown drift policy 'avg'; use check, average or first");
}

// The ```yaml blocks of docs/rules.md, read in order, form the worked example
// (the field reference's snippets are ```yaml excerpt blocks).
TEST(RuleSetBuiltin, DocsWorkedExampleLoads) {
  std::ifstream in(std::string(RESHARD_SOURCE_DIR) + "/docs/rules.md");
  ASSERT_TRUE(in) << "docs/rules.md not found";
  std::string yaml, line;
  bool in_block = false;
  while (std::getline(in, line)) {
    if (line == "```yaml" || (in_block && line == "```")) {
      in_block = !in_block;
    } else if (in_block) {
      yaml += line + "\n";
    }
  }
  Result<RuleSet> rs = RuleSet::LoadString(yaml, "docs/rules.md");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  EXPECT_EQ(rs->name(), "llama-qknorm");
  Result<const ParamRule*> qk = rs->Match("block", "self_attention.k_norm.weight");
  ASSERT_TRUE(qk.ok() && *qk != nullptr);
  EXPECT_EQ((*qk)->Describe(), "replicated");
  EXPECT_EQ((*qk)->CanonicalName("self_attention.k_norm.weight", 7, 4),
            "layers.4.self_attention.k_norm.weight");
  EXPECT_EQ(rs->layers().at("pre_norm")[0].CanonicalName("weight", 2, -1),
            "embedding.word_embeddings.norm.weight");
  EXPECT_EQ(rs->numberings().at("default")[2].role, "pre_norm");
}

TEST(RuleSetBuiltin, DirectoryFromEnvironment) {
  TempDir dir;
  dir.Write("b.yaml", Tiny({{1, "name: second"}}));
  dir.Write("a.yaml", Tiny());
  dir.Write("notes.txt", "not a rule file");
  ScopedEnv env("RESHARD_RULES_DIR", dir.path());
  Result<std::vector<RuleSet>> sets = LoadBuiltinRuleSets();
  ASSERT_TRUE(sets.ok()) << sets.status().message();
  ASSERT_EQ(sets->size(), 2u);
  EXPECT_EQ((*sets)[0].name(), "tiny");  // sorted by file name
  EXPECT_EQ((*sets)[1].name(), "second");

  dir.Write("c.yaml", Tiny());
  Result<std::vector<RuleSet>> dup = LoadBuiltinRuleSets();
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("rule set name 'tiny' is already used by"), std::string::npos)
      << dup.status().message();
}

// ---- the hf section (HfExport) ----------------------------------------------

// kTiny's lines 21.. : an hf section; tests replace numbered lines.
const std::map<int, std::string> kHf = {
    {21, "hf:"},
    {22, "  architecture: TinyForCausalLM"},
    {23, "  requires: {apply_layernorm_1p: '!true'}"},
    {24, "  config:"},
    {25, "    hidden_size: args.hidden_size"},
    {26, "    num_key_value_heads: [args.num_key_value_heads, args.num_attention_heads]"},
    {27, "    rope_theta: [args.rope_theta, 10000.0]"},
    {28, "    hidden_act: silu"},
    {29, "    activation_function:"},
    {30, "      - {when: {bias_gelu_fusion: true}, value: gelu_new}"},
    {31, "      - {when: {bias_gelu_fusion: false}, value: gelu}"},
    {32, "    rope_scaling: null"},
    {33, "  tensors:"},
    {34, "    - {from: 'embedding.w', to: 'wte'}"},
    {35, "    - from: 'layers.{block}.qkv'"},
    {36, "      to: ['h.{block}.q', 'h.{block}.k', 'h.{block}.v']"},
    {37, "      split_qkv: {groups: args.num_key_value_heads, heads: 4}"},
    {38, "    - {from: 'layers.{block}.fc', to: ['h.{block}.gate', 'h.{block}.up'], split_halves: true}"},
};

std::string TinyHf(const std::map<int, std::string>& edits = {}) {
  std::map<int, std::string> lines = kHf;
  for (const auto& [n, line] : edits) lines[n] = line;
  return Tiny(lines);
}

TEST(RuleSetHf, ParsesEveryField) {
  Result<RuleSet> rs = RuleSet::LoadString(TinyHf(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const HfExport* hf = rs->section<HfExport>();
  ASSERT_NE(hf, nullptr);
  EXPECT_EQ(hf->architecture, "TinyForCausalLM");
  EXPECT_EQ(hf->requirements, (ArgConditions{{"apply_layernorm_1p", "!true"}}));
  ASSERT_EQ(hf->config.size(), 6u);
  EXPECT_EQ(hf->config[0].key, "hidden_size");
  EXPECT_EQ(hf->config[0].paths, std::vector<std::string>{"args.hidden_size"});
  EXPECT_EQ(hf->config[0].literal, nullptr);
  EXPECT_EQ(hf->config[1].paths.size(), 2u);
  ASSERT_NE(hf->config[2].literal, nullptr);  // a number after the path: the fallback
  EXPECT_EQ(hf->config[2].literal->as_float(), 10000.0);
  EXPECT_EQ(hf->config[3].literal->as_string(), "silu");  // no dot: a literal, not a path
  ASSERT_EQ(hf->config[4].cases.size(), 2u);
  EXPECT_EQ(hf->config[4].cases[1].when, (ArgConditions{{"bias_gelu_fusion", "false"}}));
  EXPECT_EQ(hf->config[4].cases[1].value->as_string(), "gelu");
  EXPECT_TRUE(hf->config[5].literal->is_none());
  ASSERT_EQ(hf->tensors.size(), 3u);
  EXPECT_EQ(hf->tensors[1].split, HfTensorMap::Split::kQkv);
  EXPECT_EQ(hf->tensors[1].to.size(), 3u);
  EXPECT_EQ(hf->tensors[1].heads.ToString(), "4");
  EXPECT_EQ(hf->tensors[1].line, 35);
  EXPECT_EQ(hf->tensors[2].split, HfTensorMap::Split::kHalves);
  EXPECT_FALSE(hf->tensors[2].transpose);
  Result<RuleSet> shaped = RuleSet::LoadString(
      TinyHf({{38, "    - {from: 'layers.{block}.fc', to: 'h.{block}.fc', shape: [4*args.hidden_size, 16]}"}}), "t.yaml");
  ASSERT_TRUE(shaped.ok()) << shaped.status().message();
  EXPECT_EQ(shaped->section<HfExport>()->tensors[2].shape, (std::vector<std::string>{"4*args.hidden_size", "16"}));
  EXPECT_TRUE(shaped->ValuePaths().count("args.hidden_size"));
  EXPECT_EQ(RuleSet::LoadString(Tiny(), "t.yaml")->section<HfExport>(), nullptr);
}

TEST(RuleSetHf, ItsPathsCanBeSet) {
  Result<RuleSet> rs = RuleSet::LoadString(TinyHf(), "t.yaml");
  ASSERT_TRUE(rs.ok());
  const std::set<std::string> paths = rs->ValuePaths();
  for (const char* path : {"args.hidden_size", "args.rope_theta", "args.bias_gelu_fusion",
                           "args.apply_layernorm_1p", "args.num_key_value_heads"}) {
    EXPECT_TRUE(paths.count(path)) << path;
  }
}

// Megatron-Core's RoPE scaling: a case whose value is a mapping of literals
// and paths, and a null case; the Megatron-DeepSpeed model refuses it.
TEST(RuleSetHf, ACaseValueMayBeAMappingOrNull) {
  Result<RuleSet> rs = RuleSet::LoadString(
      TinyHf({{9, "  tied_module: embed\n  requires: {use_rope_scaling: '!true'}"},
              {32, "    rope_scaling:\n"
                   "      - when: {use_rope_scaling: true}\n"
                   "        value: {rope_type: llama3, factor: [args.rope_scaling_factor, 8.0], low_freq_factor: 1.0}\n"
                   "        why_not: only these\n"
                   "      - {when: {use_rope_scaling: '!true'}, value: null}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const HfConfigField& scaling = rs->section<HfExport>()->config[5];
  ASSERT_EQ(scaling.cases.size(), 2u);
  const HfConfigField::Case& scaled = scaling.cases[0];
  EXPECT_EQ(scaled.value, nullptr);
  EXPECT_EQ(scaled.why_not, "only these");
  ASSERT_EQ(scaled.entries.size(), 3u);
  EXPECT_EQ(scaled.entries[0].literal->as_string(), "llama3");
  EXPECT_EQ(scaled.entries[1].key, "factor");
  EXPECT_EQ(scaled.entries[1].paths, std::vector<std::string>{"args.rope_scaling_factor"});
  EXPECT_EQ(scaled.entries[1].literal->as_float(), 8.0);
  EXPECT_EQ(scaled.entries[2].literal->as_float(), 1.0);  // a number, not a path
  EXPECT_TRUE(scaling.cases[1].value->is_none());
  EXPECT_EQ(rs->pipeline_requirements(), (ArgConditions{{"use_rope_scaling", "!true"}}));
  for (const char* path : {"args.rope_scaling_factor", "args.use_rope_scaling"}) {
    EXPECT_TRUE(rs->ValuePaths().count(path)) << path;
  }
  EXPECT_NE(ErrorOf(TinyHf({{32, "    rope_scaling:\n      - {when: {a: true}, value: [1, 2]}"}}))
                .find("t.yaml:33: a case of hf.config.rope_scaling needs when: {args field: value}, a value"),
            std::string::npos);
  EXPECT_NE(ErrorOf(TinyHf({{9, "  tied_module: embed\n  requires: [use_rope_scaling]"}}))
                .find("t.yaml:10: pipeline.requires must be a mapping"),
            std::string::npos);
}

TEST(RuleSetHf, ErrorsNameTheLine) {
  const std::vector<std::pair<std::map<int, std::string>, std::string>> cases = {
      {{{22, "  architecure: X"}}, "t.yaml:22: unknown field 'architecure' in hf; did you mean 'architecture'?"},
      {{{22, "  tensors_only: true"}}, "t.yaml:21: missing hf.architecture"},
      {{{25, "    vocab_size: args.padded_vocab_size"}}, "t.yaml:25: hf.config.vocab_size is written by reshard"},
      {{{27, "    rope_theta: [10000.0, args.rope_theta]"}},
       "t.yaml:27: hf.config.rope_theta: 'args.rope_theta' follows a literal value"},
      {{{34, "    - {from: 'embedding.w', to: ['a', 'b']}"}},
       "t.yaml:34: to lists 2 names; dividing a tensor needs split_halves or split_qkv"},
      {{{34, "    - {from: 'embedding.w', to: 'h.{block}.wte'}"}}, "must use the same placeholders ({block}, {expert})"},
      {{{36, "      to: ['h.{layer}.q', 'h.{block}.k', 'h.{block}.v']"}},
       "t.yaml:36: hf tensor name 'h.{layer}.q': the only placeholders are {block} (the 0-based block) and {expert}"},
      {{{37, "      split_qkv: {groups: 2}"}}, "t.yaml:37: split_qkv needs groups"},
      {{{38, "    - {from: 'layers.{block}.fc', to: ['h.{block}.gate'], split_halves: true}"}},
       "t.yaml:38: split_halves writes two tensors"},
      {{{38, "    - {from: 'layers.{block}.fc', to: ['h.{block}.q', 'x.{block}'], split_halves: true}"}},
       "t.yaml:38: hf.tensors writes 'h.{block}.q' twice (first at line 35)"},
      {{{38, "    - {from: 'layers.{block}.fc', to: 'h.{block}.fc', shape: [4*hidden_size]}"}},
       "t.yaml:38: hf.tensors shape dim '4*hidden_size' must be an integer, a metadata path, N*path or * (any size)"},
  };
  for (const auto& [edits, want] : cases) {
    EXPECT_NE(ErrorOf(TinyHf(edits)).find(want), std::string::npos) << want;
  }
}


// ---- the torch_dist section (TorchDistLayout) ----------------------------------

// kTiny's lines 21.. : a torch_dist section; tests replace numbered lines.
const std::map<int, std::string> kTorchDist = {
    {21, "torch_dist:"},
    {22, "  args:"},
    {23, "    num_key_value_heads: {from: args.num_query_groups, when: {group_query_attention: true}}"},
    {24, "    rope_theta: args.rotary_base"},
    {25, "    normalization: {value: rmsnorm, when: {normalization: RMSNorm}}"},
    {26, "  tensors:"},
    {27, "    - {name: embedding.w, key: embedding.word_embeddings.weight, shape: ['*', args.hidden_size]}"},
    {28, "    - {name: 'layers.{block}.qkv', key: [decoder.layers.a.qkv, decoder.layers.b.qkv], "
         "shape: [3*args.h, 16]}"},
    {29, "    - {name: 'layers.{block}.proj', key: decoder.layers.proj, local: decoder.layers.norm.proj}"},
    {30, "    - {name: head.w, key: output_layer.weight}"},
    {31, "  optimizer_order: [embedding.word_embeddings.weight, decoder.layers.a.qkv, decoder.layers.b.qkv,"},
    {32, "                    decoder.layers.proj, output_layer.weight]"},
    {33, "  extra_state: [decoder.layers.a]"},
    {34, "  torch_extra_state: [output_layer]"},
    {35, "  te_extra_state: [decoder.layers.core_attention, decoder.final_layernorm]"},
    {36, "  tied_head: output_layer.weight"},
};

std::string TinyTorchDist(const std::map<int, std::string>& edits = {}) {
  std::map<int, std::string> lines = kTorchDist;
  for (const auto& [n, line] : edits) lines[n] = line;
  return Tiny(lines);
}

TEST(RuleSetTorchDist, ParsesEveryField) {
  Result<RuleSet> rs = RuleSet::LoadString(TinyTorchDist(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const TorchDistLayout* td = rs->section<TorchDistLayout>();
  ASSERT_NE(td, nullptr);
  ASSERT_EQ(td->args.size(), 3u);
  EXPECT_EQ(td->args[0].set, "num_key_value_heads");
  EXPECT_EQ(td->args[0].from, "args.num_query_groups");
  EXPECT_EQ(td->args[0].when, (ArgConditions{{"group_query_attention", "true"}}));
  EXPECT_EQ(td->args[1].from, "args.rotary_base");
  EXPECT_TRUE(td->args[1].when.empty());
  ASSERT_NE(td->args[2].value, nullptr);
  EXPECT_EQ(td->args[2].value->as_string(), "rmsnorm");
  ASSERT_EQ(td->tensors.size(), 4u);
  EXPECT_EQ(td->tensors[0].keys, std::vector<std::string>{"embedding.word_embeddings.weight"});
  EXPECT_EQ(td->tensors[1].name, "layers.{block}.qkv");
  EXPECT_EQ(td->tensors[1].keys.size(), 2u);
  EXPECT_EQ(td->tensors[1].shape, (std::vector<std::string>{"3*args.h", "16"}));
  EXPECT_EQ(td->tensors[1].line, 28);
  EXPECT_EQ(td->extra_state, std::vector<std::string>{"decoder.layers.a"});
  EXPECT_EQ(td->optimizer_order,
            (std::vector<std::string>{"embedding.word_embeddings.weight", "decoder.layers.a.qkv", "decoder.layers.b.qkv",
                                      "decoder.layers.proj", "output_layer.weight"}));
  EXPECT_EQ(td->torch_extra_state, std::vector<std::string>{"output_layer"});
  EXPECT_EQ(td->te_extra_state, (std::vector<std::string>{"decoder.layers.core_attention", "decoder.final_layernorm"}));
  EXPECT_EQ(td->tied_head, "output_layer.weight");
  const std::set<std::string> paths = rs->ValuePaths();
  for (const char* path : {"args.num_query_groups", "args.group_query_attention", "args.rotary_base",
                           "args.normalization", "args.hidden_size", "args.h"}) {
    EXPECT_TRUE(paths.count(path)) << path;
  }
  EXPECT_EQ(RuleSet::LoadString(Tiny(), "t.yaml")->section<TorchDistLayout>(), nullptr);
}

// Every built-in set that reads torch_dist gives the registration order the
// dp_reshardable buffers need: embedding first, the input norm before the
// attention's linear_proj and linear_qkv, the head last where it is untied.
TEST(RuleSetTorchDist, BuiltinSetsGiveTheRegistrationOrder) {
  for (const char* name : {"megatron-core-gpt", "megatron-llama", "megatron-llama-tied"}) {
    SCOPED_TRACE(name);
    Result<RuleSet> rs = LoadRuleSet(name);
    ASSERT_TRUE(rs.ok()) << rs.status().message();
    const std::vector<std::string>& order = rs->section<TorchDistLayout>()->optimizer_order;
    ASSERT_FALSE(order.empty());
    EXPECT_EQ(order.front(), "embedding.word_embeddings.weight");
    auto at = [&](const std::string& key) { return std::find(order.begin(), order.end(), key) - order.begin(); };
    EXPECT_LT(at("decoder.layers.self_attention.linear_qkv.layer_norm_weight"),
              at("decoder.layers.self_attention.linear_proj.weight"));
    EXPECT_LT(at("decoder.layers.self_attention.linear_proj.weight"), at("decoder.layers.self_attention.linear_qkv.weight"));
    EXPECT_EQ(order.back(), std::string(name) == "megatron-llama-tied" ? "decoder.final_layernorm.weight"
                                                                       : "output_layer.weight");
  }
}

// Each layer spec's key: the local spec's module where `local` names one,
// else the first alternative (Transformer Engine's name); reading tries both.
TEST(RuleSetTorchDist, KeyOfEachLayerSpec) {
  Result<RuleSet> rs = RuleSet::LoadString(TinyTorchDist(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const TorchDistTensor& qkv = rs->section<TorchDistLayout>()->tensors[1];
  const TorchDistTensor& norm = rs->section<TorchDistLayout>()->tensors[2];
  EXPECT_EQ(norm.local_key, "decoder.layers.norm.proj");
  EXPECT_EQ(norm.keys, (std::vector<std::string>{"decoder.layers.proj", "decoder.layers.norm.proj"}));
  EXPECT_EQ(TorchDistLayout::KeyOf(norm, LayerSpec::kLocal), "decoder.layers.norm.proj");
  EXPECT_EQ(TorchDistLayout::KeyOf(norm, LayerSpec::kTransformerEngine), "decoder.layers.proj");
  EXPECT_TRUE(qkv.local_key.empty());
  EXPECT_EQ(TorchDistLayout::KeyOf(qkv, LayerSpec::kLocal), "decoder.layers.a.qkv");
  EXPECT_EQ(TorchDistLayout::KeyOf(qkv, LayerSpec::kTransformerEngine), "decoder.layers.a.qkv");
  // A `local` key already among the alternatives is not read twice.
  rs = RuleSet::LoadString(
      TinyTorchDist({{29, "    - {name: 'layers.{block}.proj', key: [decoder.layers.proj, decoder.layers.n], local: "
                          "decoder.layers.n}"}}),
      "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  EXPECT_EQ(rs->section<TorchDistLayout>()->tensors[2].keys, (std::vector<std::string>{"decoder.layers.proj", "decoder.layers.n"}));
}

TEST(RuleSetTorchDist, ReportsFileLineAndFix) {
  const std::pair<std::map<int, std::string>, std::string> cases[] = {
      {{{27, "    - {name: embedding.w}"}}, "t.yaml:27: a torch_dist.tensors entry needs name"},
      {{{27, "    - {name: embedding.w, key: 'decoder.layers.{block}.w'}"}}, "has a placeholder"},
      {{{27, "    - {name: 'x.{layer}', key: a.b}"}}, "the placeholders are {block} (the 0-based block) and {expert}"},
      {{{27, "    - {name: 'x.{expert}', key: a.b}"}}, "has {expert} without {block} before it"},
      {{{27, "    - {name: 'x.{expert}.{block}', key: a.b}"}}, "has {expert} without {block} before it"},
      {{{28, "    - {name: embedding.w, key: c.d}"}}, "t.yaml:28: torch_dist.tensors maps 'embedding.w' twice"},
      {{{27, "    - {name: embedding.w, key: a.b, shape: [x]}"}}, "torch_dist.tensors shape dim 'x'"},
      {{{24, "    rope_theta: {from: args.rotary_base, value: 1}"}},
       "t.yaml:24: torch_dist.args.rope_theta needs one of"},
      {{{24, "    rope_theta: rotary_base"}}, "must name a metadata path"},
      {{{27, "    - {name: embedding.w, key: a.b, shap: [1]}"}}, "unknown field 'shap'"},
      {{{26, "  tensors: []"}, {27, ""}, {28, ""}, {29, ""}, {30, ""}, {31, ""}, {32, ""}},
       "torch_dist.tensors must be a non-empty list"},
      {{{31, "  optimizer_order: []"}, {32, ""}}, "t.yaml:31: torch_dist.optimizer_order is an empty list"},
      {{{31, "  optimizer_order: embedding.word_embeddings.weight"}, {32, ""}}, "must be a list of strings"},
      {{{32, "                    decoder.layers.proj, output_layer.weight, decoder.layers.x]"}},
       "t.yaml:31: torch_dist.optimizer_order names 'decoder.layers.x', which no torch_dist.tensors entry has"},
      {{{32, "                    decoder.layers.proj, output_layer.weight, decoder.layers.proj]"}},
       "lists 'decoder.layers.proj' twice"},
      {{{32, "                    output_layer.weight, decoder.layers.proj]"}}, "interleaves the block keys with others"},
      {{{32, "                    decoder.layers.proj]"}}, "gives no place to 'head.w' (line 30); add its key output_layer.weight"},
      {{{33, "  extra_state: decoder.layers.a"}}, "torch_dist.extra_state must be a list of strings"},
      {{{35, "  te_extra_state: decoder.final_layernorm"}}, "torch_dist.te_extra_state must be a list of strings"},
      {{{29, "    - {name: 'layers.{block}.proj', key: decoder.layers.proj, local: 'decoder.layers.{block}.n'}"}},
       "has a placeholder"},
      {{{29, "    - {name: 'layers.{block}.proj', key: decoder.layers.proj, local: [c.d]}"}}, "torch_dist.tensors local"},
  };
  for (const auto& [edits, expected] : cases) {
    const std::string message = ErrorOf(TinyTorchDist(edits));
    EXPECT_NE(message.find(expected), std::string::npos) << "missing '" << expected << "' in:\n" << message;
  }
}

// ---- the torchtitan section (TorchtitanLayout) -------------------------------

// kHf's section, then a torchtitan section at lines 39.. ; tests replace numbered lines.
const std::map<int, std::string> kTorchtitan = {
    {39, "torchtitan:"},
    {40, "  tensors:"},
    {41, "    - {hf: wte, key: tok_embeddings.weight, tp: {dim: 0}}"},
    {42, "    - {hf: 'h.{block}.q', key: 'layers.{block}.wq', interleaved_heads: n, tp: {dim: 0, blocks: n}}"},
    {43, "    - {hf: 'h.{block}.o', key: 'layers.{block}.wo', tp: {dim: 1, blocks: n}}"},
    {44, "    - {hf: 'h.{block}.norm', key: 'layers.{block}.norm'}"},
};

std::string TinyTorchtitan(const std::map<int, std::string>& edits = {}) {
  std::map<int, std::string> lines = kTorchtitan;
  for (const auto& [n, line] : edits) lines[n] = line;
  return TinyHf(lines);
}

TEST(RuleSetTorchtitan, ParsesTheTpPlacements) {
  Result<RuleSet> rs = RuleSet::LoadString(TinyTorchtitan(), "t.yaml");
  ASSERT_TRUE(rs.ok()) << rs.status().message();
  const TorchtitanLayout* tt = rs->section<TorchtitanLayout>();
  ASSERT_NE(tt, nullptr);
  ASSERT_EQ(tt->tensors.size(), 4u);
  EXPECT_EQ(std::make_pair(tt->tensors[0].tp_dim, tt->tensors[0].tp_blocks), std::make_pair(0, std::string()));
  EXPECT_EQ(std::make_pair(tt->tensors[1].tp_dim, tt->tensors[1].tp_blocks), std::make_pair(0, std::string("n")));
  EXPECT_EQ(std::make_pair(tt->tensors[2].tp_dim, tt->tensors[2].tp_blocks), std::make_pair(1, std::string("n")));
  EXPECT_EQ(tt->tensors[3].tp_dim, -1);  // replicated on the TP mesh
}

TEST(RuleSetTorchtitan, ReportsWhatIsWrongWithTp) {
  const std::pair<std::map<int, std::string>, std::string> cases[] = {
      {{{41, "    - {hf: wte, key: tok_embeddings.weight, tp: {dim: 2}}"}},
       "t.yaml:41: torchtitan.tensors tp needs dim: 0 (rows: ColwiseParallel, an Embedding) or 1"},
      {{{41, "    - {hf: wte, key: tok_embeddings.weight, tp: {blocks: n}}"}}, "tp needs dim: 0"},
      {{{41, "    - {hf: wte, key: tok_embeddings.weight, tp: {dim: 0, block: n}}"}}, "unknown field 'block'"},
      {{{41, "    - {hf: wte, key: tok_embeddings.weight, tp: 0}"}}, "torchtitan.tensors tp must be a mapping"},
      {{{43, "    - {hf: 'h.{block}.o', key: 'layers.{block}.wo', tp: {dim: 1, blocks: 'n +'}}"}}, "t.yaml:43:"},
  };
  for (const auto& [edits, expected] : cases) {
    const std::string message = ErrorOf(TinyTorchtitan(edits));
    EXPECT_NE(message.find(expected), std::string::npos) << "missing '" << expected << "' in:\n" << message;
  }
}

}  // namespace
}  // namespace reshard
