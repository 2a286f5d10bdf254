// The plain torch optimizer state of fp32 checkpoints without ZeRO, on
// fixtures written with a real torch.optim.AdamW: how SourceOptimizer reads
// it (per-element and scalar states, one tensor per parameter), and the
// state_dict BuildOptimizerState makes for a target stage (indices, scalars
// with storages of their own, states produced like their weights).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <set>

#include "formats/deepspeed/pipeline/pipeline_plan.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/optimizer/state_tensor.h"
#include "formats/deepspeed/optimizer/zero_shard_reader.h"
#include "formats/deepspeed/pipeline/zero_shard_writer.h"
#include "plan/materialize.h"
#include "test_util.h"

namespace reshard {
namespace {

class TorchOptimizerTest : public ::testing::Test {
 protected:
  // ms_gpt2 at TP 2, PP 2 with the torch AdamW state; `edit` is Python run on
  // each mp_rank file's loaded dict `sd` before reading it back.
  const LogicalCheckpoint& Load(const std::string& edit = "") {
    const std::filesystem::path root = dir_.path() / "ckpt";
    EXPECT_TRUE(MakeFixture("--style ms_gpt2 --tp 2 --pp 2 --optimizer torch_adamw", root).ok());
    if (!edit.empty()) {
      const std::string script =
          "import glob, torch\n"
          "from fixtures import megatron_fixture as mf\n"
          "mf.install_pickle_shims()\n"
          "for path in sorted(glob.glob('" + (root / "global_step10").string() + "/mp_rank_*')):\n"
          "    sd = torch.load(path, weights_only=False)\n"
          "    mp = int(path.split('mp_rank_')[1][:2])\n"
          "    " + edit + "\n"
          "    torch.save(sd, path)\n";
      const std::string cmd = std::string("PYTHONPATH=") + RESHARD_SOURCE_DIR + "/tests " +
                              RESHARD_PYTHON + " -c \"" + script + "\"";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    Result<CheckpointFiles> files = ScanCheckpoint(root.string());
    EXPECT_TRUE(files.ok()) << files.status().message();
    Result<std::unique_ptr<DeepSpeedModel>> model = ReadDeepSpeedModel(std::move(*files), CommonOptions{});
    EXPECT_TRUE(model.ok()) << model.status().message();
    model_ = std::move(model).value();
    return model_->logical;
  }

  // The mp_rank file's state tensor `key` of parameter `index`.
  const Tensor& StoredState(int mp, int index, const std::string& key) const {
    const Value* optimizer = Find(model_->logical.metadata[mp], "optimizer");
    for (const auto& [k, state] : *DictItems(*Find(*optimizer, "state"))) {
      if (k.as_int() == index) return Find(state, key)->as_tensor();
    }
    ADD_FAILURE() << "no state " << index;
    return Find(*optimizer, "state")->as_tensor();
  }

  TempDir dir_;
  std::unique_ptr<DeepSpeedModel> model_;
};

TEST_F(TorchOptimizerTest, StatesShapedLikeTheParameterArePerElementTheRestScalar) {
  const LogicalCheckpoint& src = Load();
  Result<std::unique_ptr<SourceOptimizer>> opt = ShardOptimizer::Load(src, {}, {});
  ASSERT_TRUE(opt.ok()) << opt.status().message();
  const SourceOptimizer& o = **opt;
  EXPECT_TRUE(o.format().embedded);
  EXPECT_TRUE(o.format().per_parameter);
  EXPECT_FALSE(o.HasMasters());
  EXPECT_EQ(o.states(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(o.scalar_states(), (std::vector<std::string>{"step"}));
  EXPECT_EQ(o.num_groups(), 2);  // megatron-gpt2: decay, no decay

  // Stage 1 (mp_rank_02/03) starts with the tied copies; index 2 is the
  // first block's fused QKV matrix. Locate points into the mp_rank file of
  // the stage that owns a parameter, TP rank by TP rank.
  Result<SourceShard> qkv = o.Locate("4.self_attention.query_key_value.weight", 1, "exp_avg_sq");
  ASSERT_TRUE(qkv.ok()) << qkv.status().message();
  const Tensor& stored = StoredState(3, 2, "exp_avg_sq");
  ASSERT_EQ(qkv->runs.size(), 1u);
  EXPECT_EQ(qkv->runs[0].bytes.data, TensorData(stored));
  EXPECT_EQ(qkv->numel(), stored.numel());
  EXPECT_EQ(qkv->at.tp, 1);
  EXPECT_EQ(qkv->at.pp, 1);
  // Tied parameters are read from the first stage.
  Result<SourceShard> tied = o.Locate("tied_modules.embed.word_embeddings.weight", 0, "exp_avg");
  ASSERT_TRUE(tied.ok());
  EXPECT_EQ(tied->runs[0].bytes.data, TensorData(StoredState(0, 0, "exp_avg")));
}

TEST_F(TorchOptimizerTest, TargetStageIsReindexedWithScalarsOfItsOwn) {
  const LogicalCheckpoint& src = Load();
  Result<std::unique_ptr<SourceOptimizer>> opt = ShardOptimizer::Load(src, {}, {});
  ASSERT_TRUE(opt.ok()) << opt.status().message();
  PlanOptions options;  // TP 1, PP 1
  Result<DeepSpeedPlan> plan = MakePipelinePlan(src, opt->get(), options);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_EQ(plan->optimizer.size(), 1u);
  const OptimizerStagePlan& stage = plan->optimizer[0];
  ASSERT_EQ(stage.groups.size(), 2u);
  EXPECT_EQ(stage.groups[0].dp(), 1);  // nothing is partitioned without ZeRO

  std::atomic<int64_t> read{0};
  Result<std::vector<Value>> built = BuildOptimizerState(**opt, stage, plan->dp, &read);
  ASSERT_TRUE(built.ok()) << built.status().message();
  ASSERT_EQ(built->size(), 1u);
  const Value& sd = (*built)[0];
  const std::vector<Value>& groups = Find(sd, "param_groups")->as_list().items;
  ASSERT_EQ(groups.size(), 2u);
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> params;
    ASSERT_TRUE(ReadIntSequence(*Find(groups[g], "params"), &params));
    ASSERT_EQ(params.size(), stage.groups[g].slots().size());
    for (int64_t p : params) EXPECT_EQ(p, index++);
    EXPECT_EQ(Find(groups[g], "name")->as_string(), g == 0 ? "wd_no_scale_lr" : "no_wd_no_scale_lr");
  }
  const Items& state = *DictItems(*Find(sd, "state"));
  ASSERT_EQ(static_cast<int64_t>(state.size()), index);
  std::set<const Storage*> steps;
  for (const auto& [k, entry] : state) {
    ASSERT_EQ(DictItems(entry)->size(), 3u);
    EXPECT_EQ((*DictItems(entry))[0].first.as_string(), "step");  // the source's key order
    steps.insert(Find(entry, "step")->as_tensor().storage.get());
  }
  EXPECT_EQ(static_cast<int64_t>(steps.size()), index) << "parameters share a step storage";

  // A column-parallel matrix merged from both TP ranks: its moment is
  // produced from the two source tensors like the weight from its shards.
  const std::vector<FlatSlot>& slots = stage.groups[0].slots();
  size_t slot = 0;
  while (slot < slots.size() && slots[slot].name != "2.mlp.dense_h_to_4h.weight") ++slot;
  ASSERT_LT(slot, slots.size());
  const Tensor& moment = Find(state[slot].second, "exp_avg")->as_tensor();
  EXPECT_EQ(moment.sizes, slots[slot].shape);
  std::vector<uint8_t> got(static_cast<size_t>(moment.numel()) * 4);
  ASSERT_TRUE(moment.storage->produce(0, static_cast<int64_t>(got.size()), got.data()).ok());
  Result<StateTensor> located = LocateState(src, **opt, slots[slot].name, "exp_avg");
  ASSERT_TRUE(located.ok());
  const TensorPlan& weight_plan = stage.slots[0][slot].master;
  std::vector<uint8_t> want(got.size());
  MaterializeRange(SourceTensor::Of(located->tensor), weight_plan, 0, moment.numel(), want.data(), nullptr);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0);
  // The first half of the rows is TP rank 0's tensor, the second TP rank 1's.
  EXPECT_EQ(std::memcmp(got.data(), TensorData(StoredState(0, 4, "exp_avg")), got.size() / 2), 0);
  EXPECT_EQ(std::memcmp(got.data() + got.size() / 2, TensorData(StoredState(1, 4, "exp_avg")), got.size() / 2), 0);
}

TEST_F(TorchOptimizerTest, RefusesStepsThatDisagree) {
  const LogicalCheckpoint& src = Load("if mp == 1: sd['optimizer']['state'][7]['step'] = torch.tensor(9.)");
  Result<std::unique_ptr<SourceOptimizer>> opt = ShardOptimizer::Load(src, {}, {});
  ASSERT_FALSE(opt.ok());
  const std::string& m = opt.status().message();
  EXPECT_NE(m.find("mp_rank_01_model_states.pt"), std::string::npos) << m;
  EXPECT_NE(m.find("'step'"), std::string::npos) << m;
  EXPECT_NE(m.find("tensor(9) but tensor(10)"), std::string::npos) << m;
}

TEST_F(TorchOptimizerTest, RefusesGroupsThatDoNotHoldTheStage) {
  const LogicalCheckpoint& src = Load(
      "if mp == 2: sd['optimizer']['param_groups'][1]['params'].append(99)");
  Result<std::unique_ptr<SourceOptimizer>> opt = ShardOptimizer::Load(src, {}, {});
  ASSERT_FALSE(opt.ok());
  const std::string& m = opt.status().message();
  EXPECT_NE(m.find("mp_rank_02_model_states.pt: torch optimizer group 1"), std::string::npos) << m;
  EXPECT_NE(m.find("--weights-only"), std::string::npos) << m;
}

}  // namespace
}  // namespace reshard
