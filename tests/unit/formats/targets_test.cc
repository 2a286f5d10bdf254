// The registry of target formats: what each declares, and PlanExport's
// refusals of what a target does not declare, made from the declarations.
#include <gtest/gtest.h>

#include <set>

#include "formats/registry.h"

namespace reshard {
namespace {

// A source the refusals come before: planning it at all is a test failure.
class UnreadSource : public SourceCheckpoint {
 public:
  void Lint(const LintOptions&, LintReport*) const override { ADD_FAILURE() << "read"; }
  std::string Describe() const override { return ""; }
  Result<OutputPlan> Plan(const ConvertOptions&, std::vector<std::string>*) const override {
    return Status::Internal("read");
  }
  Result<std::vector<FullTensor>> FullTensors(ReplicatedPolicy, std::atomic<int64_t>*) const override {
    ADD_FAILURE() << "the source was read before the options were checked";
    return Status::Internal("read");
  }
};

std::string Refusal(const ExportOptions& options) {
  UnreadSource src;
  std::vector<std::string> notes;
  Result<OutputPlan> plan = PlanExport(src, options, &notes);
  EXPECT_FALSE(plan.ok());
  return plan.ok() ? "" : plan.status().message();
}

TEST(TargetsTest, EveryTargetIsListedOnceWithOptionsNamedOnce) {
  std::set<std::string> names;
  for (const TargetFormatInfo& t : TargetFormats()) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    EXPECT_FALSE(t.help.empty()) << t.name;
    std::set<std::string> options;
    for (const FormatOptionInfo& o : t.options) EXPECT_TRUE(options.insert(o.name).second) << t.name << " " << o.name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"deepspeed", "accelerate", "consolidated", "dcp_recipe", "hf", "megatron", "torch_dist",
                                          "torchtitan", "universal"}));
}

TEST(TargetsTest, AnOptionIsRefusedWhereItsTargetIsNotTheOneAskedFor) {
  ExportOptions options;
  options.to = "hf";
  options.format_options["layer-spec"] = "te";
  EXPECT_EQ(Refusal(options), "--layer-spec is an option of --to megatron; the hf export does not take it, so leave it out");
  options.to = "universal";
  options.format_options = {{"dtype", "bf16"}};
  EXPECT_EQ(Refusal(options),
            "--dtype is an option of --to accelerate, consolidated, dcp_recipe, hf, megatron, torch_dist, torchtitan; the "
            "universal "
            "export "
            "does not take it, so leave it out");
}

TEST(TargetsTest, ALayoutSizeIsRefusedWhereTheTargetHasNone) {
  ExportOptions options;
  options.to = "torchtitan";
  options.pp = 2;
  EXPECT_EQ(Refusal(options),
            "--pp sets the layout of --to deepspeed, megatron, torch_dist; the torchtitan export has no such size, so "
            "leave it out");
  options.to = "consolidated";
  options.pp = 0;
  options.dp = 2;
  EXPECT_EQ(Refusal(options),
            "--dp sets the layout of --to deepspeed, megatron, torch_dist; the consolidated export has no such size, so "
            "leave it out");
  options.to = "megatron";
  options.dp = 0;
  options.ep = 2;
  EXPECT_EQ(Refusal(options),
            "--ep sets the layout of --to deepspeed, torch_dist; the megatron export has no such size, so leave it out");
}

TEST(TargetsTest, ConvertRefusesAnExpertParallelSizeTheTargetHasNot) {
  UnreadSource src;
  ConvertOptions options;
  options.to = "hf";
  options.target_ep = 4;
  std::vector<std::string> notes;
  Result<OutputPlan> plan = PlanConvert(src, options, &notes);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "--ep sets the layout of --to deepspeed, torch_dist; the hf export has no such size, so leave it out");
}

TEST(TargetsTest, ValuesAreCheckedAgainstTheDeclaration) {
  ExportOptions options;
  options.to = "torch_dist";
  options.format_options["optimizer-layout"] = "dp_reshardabel";
  EXPECT_EQ(Refusal(options), "--optimizer-layout does not take 'dp_reshardabel'; did you mean 'dp_reshardable'?");
  options.format_options = {{"ddp-bucket-size", "0"}};
  EXPECT_EQ(Refusal(options), "--ddp-bucket-size takes a whole number >= 1, not '0'");
  options.to = "hf5";
  EXPECT_EQ(Refusal(options), "unknown target format 'hf5'; did you mean 'hf'? (the formats: deepspeed, accelerate, "
                              "consolidated, dcp_recipe, hf, megatron, torch_dist, torchtitan, universal)");
  options.to = "HF";
  EXPECT_EQ(Refusal(options).substr(0, 50), "unknown target format 'HF'; did you mean 'hf'? (th");
  options.to = "parquet";
  EXPECT_EQ(Refusal(options), "unknown target format 'parquet'; the formats: deepspeed, accelerate, consolidated, "
                              "dcp_recipe, hf, megatron, torch_dist, torchtitan, universal");
}

TEST(TargetsTest, FormatOptionsReadWhatWasGiven) {
  ExportOptions options;
  options.to = "consolidated";
  EXPECT_EQ(FormatOption(options, "format"), "");
  options.format_options["max-shard-size"] = "1000";
  EXPECT_EQ(FormatCount(options, "max-shard-size"), 1000);
  EXPECT_EQ(FormatCount(options, "dp-shard"), 0);
}

}  // namespace
}  // namespace reshard
