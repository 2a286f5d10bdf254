// Planning on checkpoints written by the fixture generator: stage bounds,
// vocabulary padding, slices of sub-parameters, per-stage parameter names and
// the replicated-tensor policies. No tensor data is read except by the
// policy tests.
#include "formats/deepspeed/pipeline/pipeline_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "plan/materialize.h"
#include "logical/drift.h"
#include "formats/deepspeed/model/pipeline_reader.h"
#include "formats/deepspeed/model/stages.h"
#include "test_util.h"

namespace reshard {
namespace {

class PlanTest : public ::testing::Test {
 protected:
  const LogicalCheckpoint* Load(const std::string& fixture_args) {
    EXPECT_TRUE(MakeFixture(fixture_args, dir_.path() / "ckpt").ok());
    Result<CheckpointFiles> files = ScanCheckpoint((dir_.path() / "ckpt").string());
    EXPECT_TRUE(files.ok()) << files.status().message();
    Result<std::unique_ptr<DeepSpeedModel>> r = ReadDeepSpeedModel(std::move(*files), CommonOptions{});
    EXPECT_TRUE(r.ok()) << r.status().message();
    EXPECT_FALSE((*r)->logical.HasErrors()) << (*r)->logical.FirstError().message();
    models_.push_back(std::move(r).value());
    return &models_.back()->logical;
  }

  static const LogicalTensor* FindTensor(const LogicalCheckpoint& c, int layer_id, const std::string& key,
                                         int* layer_index = nullptr, int* tensor_index = nullptr) {
    for (size_t li = 0; li < c.layers.size(); ++li) {
      if (c.layers[li].id != layer_id) continue;
      for (size_t ti = 0; ti < c.layers[li].tensors.size(); ++ti) {
        if (c.layers[li].tensors[ti].key != key) continue;
        if (layer_index) *layer_index = static_cast<int>(li);
        if (tensor_index) *tensor_index = static_cast<int>(ti);
        return &c.layers[li].tensors[ti];
      }
    }
    return nullptr;
  }

  static const TensorPlan* FindPlan(const DeepSpeedPlan& plan, const std::string& file, const LogicalCheckpoint& c,
                                    const std::string& key) {
    for (const LayerFilePlan& f : plan.layer_files) {
      if (f.name != file) continue;
      for (const TensorPlan& t : f.tensors) {
        if (c.layers[t.layer_index].tensors[t.tensor_index].key == key) return &t;
      }
    }
    return nullptr;
  }

  TempDir dir_;
  std::vector<std::unique_ptr<DeepSpeedModel>> models_;
};

TEST_F(PlanTest, BloomStagesVocabularyAndFiles) {
  auto src = Load("--style bs_bloom --tp 2 --pp 2 --dp 2 --optimizer none");
  EXPECT_EQ(src->rules->name(), "bigscience-bloom");
  EXPECT_EQ(src->vocab.padded_rows, 112);
  EXPECT_EQ(src->vocab.original_size, 100);

  PlanOptions o;
  o.tp = 4;
  o.pp = 2;
  Result<DeepSpeedPlan> plan = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->stage_bounds, (std::vector<int>{0, 5, 11}));
  EXPECT_EQ(plan->padded_vocab, 128);  // ceil(100 / (8 * 4)) * 32
  EXPECT_EQ(plan->layer_files.size(), 6u * 4);
  EXPECT_EQ(plan->model_states.size(), 8u);
  EXPECT_EQ(plan->dp, 2);  // kept from dp_world_size

  // Rank 3 holds rows 96-127: 96-111 from source rank 1, 112-127 new padding.
  const TensorPlan* emb = FindPlan(*plan, "layer_01-model_03-model_states.pt", *src, "word_embeddings.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->shape, (std::vector<int64_t>{32, 16}));
  ASSERT_EQ(emb->copies.size(), 1u);
  EXPECT_EQ(emb->copies[0].src_shard, 1);
  EXPECT_EQ(emb->copies[0].src_offsets[0], 40);
  EXPECT_EQ(emb->copies[0].dst.sizes[0], 16);
  ASSERT_EQ(emb->fills.size(), 1u);
  EXPECT_EQ(emb->fills[0].dst.offsets[0], 16);
  EXPECT_EQ(emb->fills[0].dst.sizes[0], 16);
  ASSERT_FALSE(plan->notes.empty());
}

TEST_F(PlanTest, TiedEmbeddingOnTheLastStageWithoutItsNorm) {
  auto src = Load("--style bs_bloom --tp 1 --pp 1 --optimizer none");
  PlanOptions o;
  o.pp = 2;
  Result<DeepSpeedPlan> plan = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(plan.ok());
  auto names = [&](int stage) {
    std::vector<std::string> out;
    for (const auto& group : plan->model_states[stage].param_shapes) {
      for (const auto& [name, shape] : group) out.push_back(name);
    }
    return out;
  };
  const std::vector<std::string> first = names(0), last = names(1);
  auto has = [](const std::vector<std::string>& v, const std::string& n) {
    return std::find(v.begin(), v.end(), n) != v.end();
  };
  EXPECT_TRUE(has(first, "tied_modules.embed.word_embeddings.weight"));
  EXPECT_TRUE(has(first, "tied_modules.embed.word_embeddings.norm.weight"));
  EXPECT_TRUE(has(last, "tied_modules.embed.word_embeddings.weight"));
  EXPECT_FALSE(has(last, "tied_modules.embed.word_embeddings.norm.weight"));
  EXPECT_TRUE(has(last, "8.weight"));  // final norm
  // BigScience groups: decay halves, then no-decay (norms and biases).
  EXPECT_EQ(plan->model_states[0].param_shapes.size(), 3u);
}

TEST_F(PlanTest, SwiGluHalvesAreReshardedSeparately) {
  auto src = Load("--style ms_llama --tp 2 --pp 1 --optimizer none");
  PlanOptions o;
  o.tp = 1;
  Result<DeepSpeedPlan> plan = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(plan.ok());
  // ffn 24: every source shard is [gate 12 rows; up 12 rows]. The TP 1 tensor
  // is [gate 0-23; up 0-23], so source rank 1's gate goes to rows 12-23.
  const TensorPlan* h4h = FindPlan(*plan, "layer_02-model_00-model_states.pt", *src, "mlp.dense_h_to_4h.weight");
  ASSERT_NE(h4h, nullptr);
  ASSERT_EQ(h4h->copies.size(), 4u);
  EXPECT_EQ(h4h->copies[1].src_shard, 1);
  EXPECT_EQ(h4h->copies[1].src_offsets[0], 0);
  EXPECT_EQ(h4h->copies[1].dst.offsets[0], 12);
  EXPECT_EQ(h4h->copies[2].src_shard, 0);
  EXPECT_EQ(h4h->copies[2].src_offsets[0], 12);
  EXPECT_EQ(h4h->copies[2].dst.offsets[0], 24);
}

TEST_F(PlanTest, RefusesLayoutsTheModelCannotTake) {
  auto src = Load("--style ms_llama --tp 1 --pp 1 --optimizer none");  // 2 KV groups, 4 blocks
  PlanOptions o;
  o.tp = 4;
  Result<DeepSpeedPlan> bad_tp = MakePipelinePlan(*src, nullptr, o);
  ASSERT_FALSE(bad_tp.ok());
  EXPECT_NE(bad_tp.status().message().find("cannot split layer_02/self_attention.query_key_value.weight over 4 TP ranks: its 2 KV heads (args.num_key_value_heads) do not divide by 4"),
            std::string::npos);
  o.tp = 1;
  o.pp = 5;
  Result<DeepSpeedPlan> bad_pp = MakePipelinePlan(*src, nullptr, o);
  ASSERT_FALSE(bad_pp.ok());
  EXPECT_NE(bad_pp.status().message().find("exceeds the 4 transformer blocks"), std::string::npos);
  o.pp = 2;
  o.layers_per_stage = {1, 2};
  EXPECT_NE(MakePipelinePlan(*src, nullptr, o).status().message().find("sums to 3 but the model has 4 blocks"),
            std::string::npos);
  o.layers_per_stage = {3, 1};
  Result<DeepSpeedPlan> explicit_split = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(explicit_split.ok());
  EXPECT_EQ(explicit_split->stage_bounds, (std::vector<int>{0, 5, 9}));
}

TEST_F(PlanTest, ReplicatedPolicies) {
  auto src = Load("--style bs_bloom --tp 2 --pp 1 --optimizer none --drift 0.01");
  const std::vector<Drift> drifts = MeasureDrift(*src);
  ASSERT_FALSE(drifts.empty());
  for (size_t i = 1; i < drifts.size(); ++i) EXPECT_GE(drifts[i - 1].max_abs_diff, drifts[i].max_abs_diff);

  int li = 0, ti = 0;
  const LogicalTensor* norm = FindTensor(*src, 3, "input_layernorm.weight", &li, &ti);
  ASSERT_NE(norm, nullptr);
  PlanOptions o;
  o.replicated = ReplicatedPolicy::kAverage;
  Result<DeepSpeedPlan> plan = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(plan.ok());
  const TensorPlan* avg = FindPlan(*plan, "layer_03-model_00-model_states.pt", *src, "input_layernorm.weight");
  ASSERT_NE(avg, nullptr);
  EXPECT_TRUE(avg->average);
  std::vector<uint8_t> mean(static_cast<size_t>(avg->numel()) * 2);
  MaterializeRange(SourceTensor::Of(*norm), *avg, 0, avg->numel(), mean.data(), nullptr);
  for (int64_t i = 0; i < norm->shards[0].numel(); ++i) {
    const double a = LoadAsDouble(DType::kBFloat16, norm->shards[0].runs[0].bytes.data + 2 * i);
    const double b = LoadAsDouble(DType::kBFloat16, norm->shards[1].runs[0].bytes.data + 2 * i);
    std::vector<uint8_t> expected(2);
    StoreFromDouble(DType::kBFloat16, (a + b) / 2, expected.data());
    EXPECT_EQ(std::memcmp(expected.data(), mean.data() + 2 * i, 2), 0) << "element " << i;
  }
  o.replicated = ReplicatedPolicy::kFirst;
  Result<DeepSpeedPlan> first_plan = MakePipelinePlan(*src, nullptr, o);
  ASSERT_TRUE(first_plan.ok());
  const TensorPlan* first =
      FindPlan(*first_plan, "layer_03-model_00-model_states.pt", *src, "input_layernorm.weight");
  ASSERT_NE(first, nullptr);
  EXPECT_FALSE(first->average);
  ASSERT_EQ(first->copies.size(), 1u);
  EXPECT_EQ(first->copies[0].src_shard, 0);
}

}  // namespace
}  // namespace reshard
