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
  Result<OutputPlan> Plan(const DeepSpeedPlanOptions&, std::vector<std::string>*) const override {
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
  EXPECT_EQ(Refusal(options), "--layer-spec is an option of --to megatron; --to hf does not take it, so leave it out");
  options.to = "universal";
  options.format_options = {{"dtype", "bf16"}};
  EXPECT_EQ(Refusal(options),
            "--dtype is an option of --to accelerate, consolidated, dcp_recipe, hf, megatron, torch_dist, torchtitan; --to "
            "universal does not take it, so leave it out");
}

TEST(TargetsTest, ALayoutSizeIsRefusedWhereTheTargetHasNone) {
  ExportOptions options;
  options.to = "torchtitan";
  options.pp = 2;
  EXPECT_EQ(Refusal(options),
            "--pp sets the layout of --to deepspeed, megatron, torch_dist; --to torchtitan has no such size, so "
            "leave it out");
  options.to = "consolidated";
  options.pp = 0;
  options.dp = 2;
  EXPECT_EQ(Refusal(options),
            "--dp sets the layout of --to deepspeed, megatron, torch_dist; --to consolidated has no such size, so "
            "leave it out");
  options.to = "megatron";
  options.dp = 0;
  options.ep = 2;
  EXPECT_EQ(Refusal(options),
            "--ep sets the layout of --to deepspeed, torch_dist; --to megatron has no such size, so leave it out");
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
            "--ep sets the layout of --to deepspeed, torch_dist; --to hf has no such size, so leave it out");
}

// A DeepSpeed source saved at TP 2 x PP 2 that records what it is asked to
// plan its own layout with.
class PlannedSource : public UnreadSource {
 public:
  PlannedSource() { SetOrigin("deepspeed", 2, 2, 1); }
  Result<OutputPlan> Plan(const DeepSpeedPlanOptions& options, std::vector<std::string>*) const override {
    asked = options;
    return OutputPlan();
  }
  mutable DeepSpeedPlanOptions asked;
};

TEST(TargetsTest, ConvertToDeepSpeedPassesTheTargetsOwnOptions) {
  PlannedSource src;
  ConvertOptions options;
  options.target_pp = 3;
  std::vector<std::string> notes;
  ASSERT_TRUE(PlanConvert(src, options, &notes).ok());
  EXPECT_EQ(src.asked.target_tp, 2);  // kept
  EXPECT_EQ(src.asked.target_pp, 3);
  EXPECT_TRUE(src.asked.layers_per_stage.empty());
  EXPECT_EQ(src.asked.vocab_pad_value, 0.0);
  EXPECT_TRUE(src.asked.update_latest);

  options.format_options = {{"layers-per-stage", "1,2,1"}, {"vocab-pad-value", "-0.5"}, {"no-update-latest", "true"}};
  ASSERT_TRUE(PlanConvert(src, options, &notes).ok());
  EXPECT_EQ(src.asked.layers_per_stage, (std::vector<int>{1, 2, 1}));
  EXPECT_EQ(src.asked.vocab_pad_value, -0.5);
  EXPECT_FALSE(src.asked.update_latest);
}

TEST(TargetsTest, TheDeepSpeedTargetsOptionsRefuseWhatTheyCannotRead) {
  PlannedSource src;
  ConvertOptions options;
  std::vector<std::string> notes;
  options.format_options = {{"layers-per-stage", "2,x"}};
  Result<OutputPlan> plan = PlanConvert(src, options, &notes);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "--layers-per-stage takes the blocks of each stage, comma-separated (e.g. 5,6,6,5), not '2,x'");
  options.format_options = {{"vocab-pad-value", "half"}};
  plan = PlanConvert(src, options, &notes);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(), "--vocab-pad-value takes a number, not 'half'");
  options.format_options = {{"no-update-latest", "no"}};
  plan = PlanConvert(src, options, &notes);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(), "--no-update-latest is a flag, given or not; it takes no value ('no')");
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
