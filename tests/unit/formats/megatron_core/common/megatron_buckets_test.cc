#include "formats/megatron_core/common/megatron_buckets.h"

#include <gtest/gtest.h>

#include <numeric>

namespace reshard {
namespace {

using Chunks = std::vector<std::pair<int64_t, int64_t>>;

BucketLayout Layout(const std::vector<BucketParam>& params, const BucketOptions& options) {
  Result<BucketLayout> layout = MegatronBucketLayout(params, options);
  EXPECT_TRUE(layout.ok()) << layout.status().message();
  return layout.ok() ? *layout : BucketLayout{};
}

void ExpectSlot(const BucketSlot& s, int bucket, int64_t offset, int64_t numel) {
  EXPECT_EQ(s.bucket, bucket);
  EXPECT_EQ(s.offset, offset);
  EXPECT_EQ(s.numel, numel);
}

// Registered A, B, C: laid out C, B, A, each start rounded up to 64.
TEST(MegatronBucketsTest, ReverseOrderEachStartAlignedTo64) {
  const BucketLayout l = Layout({{"A", 10}, {"B", 100}, {"C", 64}}, {});
  ASSERT_EQ(l.buckets.size(), 1u);
  ExpectSlot(l.slots[2], 0, 0, 64);             // C
  ExpectSlot(l.slots[1], 0, 64, 100);           // B
  ExpectSlot(l.slots[0], 0, 192, 10);           // A, after a 28-element gap
  EXPECT_EQ(l.buckets[0].numel_unpadded, 202);  // gaps count, the tail does not
  EXPECT_EQ(l.buckets[0].numel, 256);           // rounded up to 128 at DP 1
}

// The padded numel is a multiple of lcm(DP, 128), so that each DP rank owns
// an equal shard; the unpadded layout does not depend on DP.
TEST(MegatronBucketsTest, PaddingForDpSizes1To8) {
  const std::vector<BucketParam> params = {{"a", 1000}, {"b", 7}, {"c", 333}};
  const int64_t want_padded[] = {1536, 1536, 1536, 1536, 1920, 1536, 1792, 1536};
  for (int dp = 1; dp <= 8; ++dp) {
    SCOPED_TRACE(dp);
    const BucketLayout l = Layout(params, {dp});
    ASSERT_EQ(l.buckets.size(), 1u);
    EXPECT_EQ(l.buckets[0].numel_unpadded, 384 + 64 + 1000);  // c, b, a
    EXPECT_EQ(l.buckets[0].numel, want_padded[dp - 1]);
    EXPECT_EQ(l.buckets[0].numel % std::lcm(dp, 128), 0);
    ExpectSlot(l.slots[0], 0, 448, 1000);
  }
}

TEST(MegatronBucketsTest, HighNcclBusBandwidthPadsTo65536) {
  BucketOptions options{4};
  options.pad_for_high_nccl_busbw = true;
  const BucketLayout l = Layout({{"w", 70000}}, options);
  EXPECT_EQ(l.buckets[0].numel_unpadded, 70000);
  EXPECT_EQ(l.buckets[0].numel, 131072);
}

// A bucket closes after the parameter that brings it to bucket_size or
// more; the next starts at the padded end, offsets count from its start.
TEST(MegatronBucketsTest, BucketClosesOnceItReachesBucketSize) {
  BucketOptions options{2};
  options.bucket_size = 200;
  const BucketLayout l =
      Layout({{"p0", 100}, {"p1", 100}, {"p2", 100}, {"p3", 100}, {"p4", 72}}, options);
  ASSERT_EQ(l.buckets.size(), 3u);
  ExpectSlot(l.slots[4], 0, 0, 72);
  ExpectSlot(l.slots[3], 0, 128, 100);  // 228 >= 200: bucket 0 closes
  ExpectSlot(l.slots[2], 1, 0, 100);
  ExpectSlot(l.slots[1], 1, 128, 100);  // exactly 228 again
  ExpectSlot(l.slots[0], 2, 0, 100);    // the rest: a smaller last bucket
  EXPECT_EQ(l.buckets[0].start, 0);
  EXPECT_EQ(l.buckets[0].numel_unpadded, 228);
  EXPECT_EQ(l.buckets[0].numel, 256);
  EXPECT_EQ(l.buckets[1].start, 256);
  EXPECT_EQ(l.buckets[2].start, 512);
  EXPECT_EQ(l.buckets[2].numel_unpadded, 100);
  EXPECT_EQ(l.buckets[2].numel, 128);
}

TEST(MegatronBucketsTest, BucketSizeReachedExactly) {
  BucketOptions options;
  options.bucket_size = 128;
  const BucketLayout l = Layout({{"a", 64}, {"b", 64}, {"c", 64}}, options);
  ASSERT_EQ(l.buckets.size(), 2u);
  ExpectSlot(l.slots[1], 0, 64, 64);  // c + b = 128: closes
  ExpectSlot(l.slots[0], 1, 0, 64);
}

TEST(MegatronBucketsTest, DefaultBucketSize) {
  EXPECT_EQ(MegatronDefaultBucketSize(1), 40000000);
  EXPECT_EQ(MegatronDefaultBucketSize(64), 64000000);
}

// The first stage's embedding, tied to the last stage's output layer, is
// registered first, so laid out last: the bucket before it ends at its
// aligned start (the gap is in the unpadded numel) and it has its own.
TEST(MegatronBucketsTest, SharedEmbeddingGetsABucketOfItsOwn) {
  const BucketLayout l = Layout({{"embedding", 640, true}, {"norm", 16}, {"w", 256}}, {});
  ASSERT_EQ(l.buckets.size(), 2u);
  ExpectSlot(l.slots[1], 0, 256, 16);
  EXPECT_EQ(l.buckets[0].numel_unpadded, 320);
  EXPECT_EQ(l.buckets[0].numel, 384);
  ExpectSlot(l.slots[0], 1, 0, 640);
  EXPECT_EQ(l.buckets[1].start, 384);
  EXPECT_EQ(l.buckets[1].numel_unpadded, 640);
}

// At DP 4 the 256-element bucket is 4 shards of 64; every parameter piece
// and every gap inside a shard is a chunk of its own.
TEST(MegatronBucketsTest, ChunksCutAtParametersAndDpShards) {
  const BucketLayout l = Layout({{"x", 100}, {"y", 100}}, {4});
  EXPECT_EQ(l.buckets[0].numel_unpadded, 228);
  EXPECT_EQ(MegatronBucketChunks(l, 0, 4),
            (Chunks{{0, 64}, {64, 36}, {100, 28}, {128, 64}, {192, 36}}));
  EXPECT_EQ(MegatronBucketChunks(l, 0, 1), (Chunks{{0, 100}, {100, 28}, {128, 100}}));
}

TEST(MegatronBucketsTest, ChunksTileTheUnpaddedBucketForDp1To8) {
  const std::vector<BucketParam> params = {{"a", 300}, {"b", 5}, {"c", 999}, {"d", 64}};
  for (int dp = 1; dp <= 8; ++dp) {
    SCOPED_TRACE(dp);
    const BucketLayout l = Layout(params, {dp});
    int64_t next = 0;
    for (const auto& [offset, size] : MegatronBucketChunks(l, 0, dp)) {
      EXPECT_EQ(offset, next);
      EXPECT_GT(size, 0);
      next = offset + size;
    }
    EXPECT_EQ(next, l.buckets[0].numel_unpadded);
  }
}

TEST(MegatronBucketsTest, CheckNamesTheMismatch) {
  const BucketLayout l = Layout({{"a", 100}, {"b", 100}}, {});
  EXPECT_TRUE(CheckBucketNumels(l, {256}, {228}, "gbuf 0").ok());
  const Status unpadded = CheckBucketNumels(l, {256}, {200}, "gbuf 0");
  EXPECT_EQ(unpadded.code(), Status::Code::kInvalidInput);
  EXPECT_EQ(unpadded.message(),
            "gbuf 0: per_bucket_numel_unpadded [200] is not Megatron's layout of its "
            "parameters, [228]");
  const Status padded = CheckBucketNumels(l, {232}, {228}, "gbuf 0");
  EXPECT_EQ(padded.message(),
            "gbuf 0: per_bucket_numel [232] is not Megatron's padding of its buckets, [256] "
            "(another DP size or bucket padding)");
  EXPECT_FALSE(CheckBucketNumels(l, {128, 128}, {100, 100}, "gbuf 0").ok());
}

// Megatron's _ParamAndGradBuffer with a bucket size and a shared
// embedding: the bucket before the embedding closes at the embedding's
// aligned start whatever its size, then the size cuts as usual.
TEST(MegatronBucketsTest, BucketSizeAndSharedEmbedding) {
  BucketOptions options;
  options.bucket_size = 300;
  const BucketLayout l = Layout({{"embedding", 512, true}, {"a", 100}, {"b", 200}, {"c", 100}}, options);
  ASSERT_EQ(l.buckets.size(), 3u);
  ExpectSlot(l.slots[3], 0, 0, 100);    // c
  ExpectSlot(l.slots[2], 0, 128, 200);  // b: 328 >= 300 closes bucket 0
  ExpectSlot(l.slots[1], 1, 0, 100);    // a, alone below the size
  ExpectSlot(l.slots[0], 2, 0, 512);    // the embedding's own bucket
  EXPECT_EQ(l.buckets[0].numel_unpadded, 328);
  EXPECT_EQ(l.buckets[1].numel_unpadded, 128);  // a's end rounded to the embedding's aligned start
  EXPECT_EQ(l.buckets[2].numel_unpadded, 512);
}

// A recorded layout of several buckets is read without the bucket size,
// which it shows: each size that cut it, and only such a size, gives it back.
TEST(MegatronBucketsTest, RecordedLayoutFindsItsBucketSize) {
  const std::vector<BucketParam> params = {{"p0", 100}, {"p1", 100}, {"p2", 100}, {"p3", 100}, {"p4", 72}};
  for (int64_t size : {150, 200, 228, 300, 400}) {
    BucketOptions options{2};
    options.bucket_size = size;
    const BucketLayout want = Layout(params, options);
    std::vector<int64_t> numel, unpadded;
    for (const Bucket& b : want.buckets) {
      numel.push_back(b.numel);
      unpadded.push_back(b.numel_unpadded);
    }
    Result<BucketLayout> got = MegatronRecordedLayout(params, {2}, numel, unpadded, "gbuf 0");
    ASSERT_TRUE(got.ok()) << size << ": " << got.status().message();
    ASSERT_EQ(got->slots.size(), want.slots.size());
    for (size_t i = 0; i < want.slots.size(); ++i) {
      ExpectSlot(got->slots[i], want.slots[i].bucket, want.slots[i].offset, want.slots[i].numel);
    }
  }
  // Two buckets of 228 and 356 elements: no bucket size closes the first after p4, p3 and the
  // second only after 356 elements.
  const Result<BucketLayout> no_size = MegatronRecordedLayout(params, {2}, {256, 384}, {228, 356}, "gbuf 0");
  EXPECT_EQ(no_size.status().code(), Status::Code::kInvalidInput);
  EXPECT_NE(no_size.status().message().find("nor at any bucket size"), std::string::npos)
      << no_size.status().message();
}

TEST(MegatronBucketsTest, RefusesWhatIsNoLayout) {
  EXPECT_FALSE(MegatronBucketLayout({}, {}).ok());
  EXPECT_FALSE(MegatronBucketLayout({{"a", 0}}, {}).ok());
  EXPECT_FALSE(MegatronBucketLayout({{"a", 1}}, {0}).ok());
  BucketOptions zero_bucket;
  zero_bucket.bucket_size = 0;
  EXPECT_FALSE(MegatronBucketLayout({{"a", 1}}, zero_bucket).ok());
}

TEST(MegatronBucketsTest, KeysAndGroupIndex) {
  EXPECT_EQ(MegatronBucketKey({1}, 0, DType::kBFloat16, DType::kFloat32, 2, "exp_avg"),
            "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, "
            "torch.float32).bucket_idx_2.exp_avg");
  EXPECT_EQ(MegatronDpGroupIdx(1, 0, 2), 1);
  EXPECT_EQ(MegatronDpGroupIdx(0, 1, 1), 1);
  EXPECT_EQ(MegatronDpGroupIdx(1, 1, 2), 3);
}

// A ChainedOptimizer's keys (a model with experts at EP > 1), as the real
// EP 2 save names them: the dense optimizer's `chained_0.`, the experts'
// `chained_1.` with the rank in the expert TP x EP x PP group.
TEST(MegatronBucketsTest, ChainedKeysAndExpertGroupIndex) {
  EXPECT_EQ(MegatronBucketKey({1, 1}, 0, DType::kFloat32, DType::kFloat32, 0, "param"),
            "chained_1.optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float32, "
            "torch.float32).bucket_idx_0.param");
  EXPECT_EQ((MegatronDpGroup{0, 0}.ItemKey("per_bucket_numel")),
            "chained_0.optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1");
  EXPECT_EQ(MegatronDpGroup{3}.ItemKey("optimizer"), "optimizer.distributed.dp_group_idx_3.optimizer/shard_0_1");
  EXPECT_EQ(MegatronExpertDpGroupIdx(0, 1, 0, 1, 2), 1);  // TP 1, EP 2: the EP rank
  EXPECT_EQ(MegatronExpertDpGroupIdx(1, 1, 0, 2, 2), 3);  // expert TP fastest
  EXPECT_EQ(MegatronExpertDpGroupIdx(1, 0, 1, 2, 2), 5);  // then EP, then PP
}

// Keys before the layer keys on the first stage only, the layer keys once
// per layer of the stage (a layer's keys together), keys after them on the
// last stage only.
TEST(MegatronBucketsTest, StageRegistrationOrder) {
  const std::vector<std::string> order = {"emb", "layers.a", "layers.b", "norm", "out"};
  auto is_layer_key = [](const std::string& key) { return key.rfind("layers.", 0) == 0; };
  auto keys = [](const std::vector<RegisteredParam>& params) {
    std::vector<std::string> out;
    for (const RegisteredParam& p : params) out.push_back(p.key + "@" + std::to_string(p.layer));
    return out;
  };
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 0, 2, true, true)),
            (std::vector<std::string>{"emb@-1", "layers.a@0", "layers.b@0", "layers.a@1", "layers.b@1", "norm@-1",
                                      "out@-1"}));
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 0, 1, true, false)),
            (std::vector<std::string>{"emb@-1", "layers.a@0", "layers.b@0"}));
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 3, 1, false, true)),
            (std::vector<std::string>{"layers.a@3", "layers.b@3", "norm@-1", "out@-1"}));
  // A tied head the order does not place comes last, on the last stage.
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 3, 1, false, true, "head")),
            (std::vector<std::string>{"layers.a@3", "layers.b@3", "norm@-1", "out@-1", "head@-1"}));
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 3, 1, false, true, "out")),
            (std::vector<std::string>{"layers.a@3", "layers.b@3", "norm@-1", "out@-1"}));
  EXPECT_EQ(keys(StageRegistrationOrder(order, is_layer_key, 0, 1, true, false, "head")),
            (std::vector<std::string>{"emb@-1", "layers.a@0", "layers.b@0"}));
}

// Each layer's run of expert keys once per expert an optimizer holds, in
// order; the other keys only in the dense parameters' optimizer.
TEST(MegatronBucketsTest, SharedRegistrationOrder) {
  const std::vector<RegisteredParam> stage = {{"emb"},      {"norm", 0}, {"router", 0}, {"fc1", 0},
                                              {"fc2", 0},   {"norm", 1}, {"router", 1}, {"fc1", 1},
                                              {"fc2", 1},   {"out"}};
  auto is_expert_key = [](const std::string& key) { return key.rfind("fc", 0) == 0; };
  auto keys = [](const std::vector<RegisteredParam>& params) {
    std::string out;
    for (const RegisteredParam& p : params) {
      out += p.key + "@" + std::to_string(p.layer) + (p.expert >= 0 ? "." + std::to_string(p.expert) : "") + " ";
    }
    return out;
  };
  // EP 1: one optimizer holds every parameter, each layer's experts in turn.
  EXPECT_EQ(keys(SharedRegistrationOrder(stage, is_expert_key, {true, 0, 2})),
            "emb@-1 norm@0 router@0 fc1@0.0 fc2@0.0 fc1@0.1 fc2@0.1 norm@1 router@1 fc1@1.0 fc2@1.0 fc1@1.1 "
            "fc2@1.1 out@-1 ");
  // EP > 1: the dense parameters' optimizer, and EP rank 1's experts' (2 and 3).
  EXPECT_EQ(keys(SharedRegistrationOrder(stage, is_expert_key, {true, 0, 0})),
            "emb@-1 norm@0 router@0 norm@1 router@1 out@-1 ");
  EXPECT_EQ(keys(SharedRegistrationOrder(stage, is_expert_key, {false, 2, 2})),
            "fc1@0.2 fc2@0.2 fc1@0.3 fc2@0.3 fc1@1.2 fc2@1.2 fc1@1.3 fc2@1.3 ");
}

}  // namespace
}  // namespace reshard
