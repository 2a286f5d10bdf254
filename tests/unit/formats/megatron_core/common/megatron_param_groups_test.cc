// Megatron-Core's param groups made from a source's: the learning-rate
// schedule bounds its optimizer load pairs saved groups by, from the group,
// the source's args or --set, each noted, and a missing one said.
#include "formats/megatron_core/common/megatron_param_groups.h"

#include <gtest/gtest.h>
#include "test_util.h"

namespace reshard {
namespace {

// A source's two groups (decayed, not decayed) with `hyper` and step 10.
OptimizerParamGroups Groups(const Items& hyper) {
  OptimizerParamGroups groups;
  for (double mult : {1.0, 0.0}) {
    OptimizerParamGroup g;
    g.hyperparameters = Value::MakeDict(hyper);
    g.weight_decay_multiplier = mult;
    groups.groups.push_back(std::move(g));
  }
  groups.step = Value::Int(10);
  return groups;
}

const Items kTorchtitan = {{Value::String("lr"), Value::Float(3e-4)}, {Value::String("weight_decay"), Value::Float(0.1)}};

Value Args(const Items& items) { return Value::MakeDict({{Value::String("args"), Value::MakeDict(items)}}); }

std::string AllNotes(const std::vector<std::string>& notes) {
  std::string all;
  for (const std::string& n : notes) all += n + "\n";
  return all;
}

TEST(MegatronParamGroupsTest, TheSchedulesBoundsComeFromTheArgsThenFromSet) {
  const LrSchedule schedule = RunLrSchedule(Args({{Value::String("lr"), Value::Float(1e-3)}}),
                                            Args({{Value::String("min_lr"), Value::Int(0)}}));
  EXPECT_EQ(schedule.max_lr.as_float(), 1e-3);
  EXPECT_EQ(schedule.max_lr_from, "the source's args.lr");
  EXPECT_EQ(schedule.min_lr.as_float(), 0.0);  // written as Megatron-LM's float
  EXPECT_EQ(schedule.min_lr_from, "--set min_lr");
  std::vector<std::string> notes;
  const Result<Value> groups = MegatronParamGroups(Groups(kTorchtitan), schedule, "0.19", &notes);
  ASSERT_TRUE(groups.ok()) << groups.status().message();
  for (const Value& g : groups->as_list().items) {
    EXPECT_EQ(Find(g, "max_lr")->as_float(), 1e-3);
    EXPECT_EQ(Find(g, "min_lr")->as_float(), 0.0);
    EXPECT_EQ(Find(g, "lr")->as_float(), 3e-4);  // the group's own, as the step saved it
  }
  EXPECT_NE(AllNotes(notes).find("max_lr 0.001 (the source's args.lr), min_lr 0.0 (--set min_lr)"), std::string::npos)
      << AllNotes(notes);
  EXPECT_NE(AllNotes(notes).find("resume with --lr 0.001 --min-lr 0.0"), std::string::npos) << AllNotes(notes);
  Value args = Value::MakeDict();
  WriteLrSchedule(schedule, &args);
  EXPECT_EQ(Find(args, "lr")->as_float(), 1e-3);
  EXPECT_EQ(Find(args, "min_lr")->as_float(), 0.0);
}

// Without them the groups say None (not the group's current lr, which is
// not the schedule's peak), and a note names the fix.
TEST(MegatronParamGroupsTest, AMissingBoundIsSaidWithItsFix) {
  std::vector<std::string> notes;
  const Result<Value> groups =
      MegatronParamGroups(Groups(kTorchtitan), RunLrSchedule(Value::MakeDict(), Value::MakeDict()), "0.19", &notes);
  ASSERT_TRUE(groups.ok());
  EXPECT_TRUE(Find(groups->as_list().items[0], "max_lr")->is_none());
  EXPECT_TRUE(Find(groups->as_list().items[0], "min_lr")->is_none());
  EXPECT_NE(AllNotes(notes).find("the source records no max_lr or min_lr (the run's --lr and --min-lr) and none was "
                                 "given"),
            std::string::npos)
      << AllNotes(notes);
  EXPECT_NE(AllNotes(notes).find("give them: --set lr=<the run's --lr> --set min_lr=<the run's --min-lr>"),
            std::string::npos);
}

// A Megatron-Core save's groups keep their own bounds (min_lr None where its
// run gave none), with no note; --set cannot contradict them.
TEST(MegatronParamGroupsTest, AGroupsOwnBoundsAreKept) {
  const Items own = {{Value::String("lr"), Value::Float(1e-3)},
                     {Value::String("max_lr"), Value::Float(1e-3)},
                     {Value::String("min_lr"), Value::None()}};
  std::vector<std::string> notes;
  const Result<Value> groups =
      MegatronParamGroups(Groups(own), RunLrSchedule(Value::MakeDict(), Value::MakeDict()), "0.19", &notes);
  ASSERT_TRUE(groups.ok());
  EXPECT_EQ(Find(groups->as_list().items[1], "max_lr")->as_float(), 1e-3);
  EXPECT_TRUE(Find(groups->as_list().items[1], "min_lr")->is_none());
  EXPECT_EQ(AllNotes(notes).find("max_lr"), std::string::npos) << AllNotes(notes);
  const Result<Value> refused = MegatronParamGroups(
      Groups(own), RunLrSchedule(Value::MakeDict(), Args({{Value::String("lr"), Value::Float(2e-3)}})), "0.19", &notes);
  EXPECT_EQ(refused.status().message(),
            "--set lr=0.002 contradicts the source's optimizer param groups, which record max_lr 0.001; drop the --set");
  EXPECT_TRUE(MegatronParamGroups(Groups(own),
                                  RunLrSchedule(Value::MakeDict(), Args({{Value::String("lr"), Value::Float(1e-3)}})),
                                  "0.19", &notes)
                  .ok());
}

}  // namespace
}  // namespace reshard
