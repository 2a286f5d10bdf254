#include "formats/megatron_core/common/megatron_gathered.h"

#include <gtest/gtest.h>

#include <cstring>

namespace reshard {
namespace {

std::vector<GradBuffer> Buffers(const std::vector<GatheredParam>& params, int dp) {
  BucketOptions options;
  options.dp = dp;
  Result<std::vector<GradBuffer>> buffers = MegatronGradBuffers(params, options);
  EXPECT_TRUE(buffers.ok()) << buffers.status().message();
  return buffers.ok() ? *buffers : std::vector<GradBuffer>{};
}

// A tied embedding's pipeline copy is a bucket of its own; the gathered
// tensor holds the buckets' unpadded ranges one after the other, so the
// padding to lcm(DP, 128) between them is gone and nothing depends on DP.
TEST(MegatronGatheredTest, BucketsFollowOneAnotherWithoutTheirPadding) {
  const std::vector<GatheredParam> params = {{"embedding", DType::kFloat32, 100, true},
                                             {"norm", DType::kFloat32, 10, false},
                                             {"linear", DType::kFloat32, 70, false}};
  for (int dp : {1, 2, 3, 8}) {
    const std::vector<GradBuffer> b = Buffers(params, dp);
    ASSERT_EQ(b.size(), 1u);
    ASSERT_EQ(b[0].layout.buckets.size(), 2u);
    // Bucket 0: linear at 0, norm at 128 (70 rounded up to 64s), closed at the
    // embedding's aligned start, 192; bucket 1: the embedding, right after it.
    EXPECT_EQ(b[0].layout.buckets[0].numel_unpadded, 192);
    EXPECT_EQ(b[0].offsets, (std::vector<int64_t>{192, 128, 0})) << "dp " << dp;
    EXPECT_EQ(b[0].numel_unpadded, 292);
  }
}

// One grad buffer per param dtype, in the order each first appears.
TEST(MegatronGatheredTest, OneBufferPerParamDType) {
  const std::vector<GradBuffer> b = Buffers({{"a", DType::kBFloat16, 64, false},
                                             {"n", DType::kFloat32, 8, false},
                                             {"b", DType::kBFloat16, 64, false}}, 1);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].param_dtype, DType::kBFloat16);
  EXPECT_EQ(b[0].params, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(b[0].offsets, (std::vector<int64_t>{64, 0}));
  EXPECT_EQ(b[1].params, (std::vector<size_t>{1}));
  EXPECT_EQ(b[1].numel_unpadded, 8);
}

// The object made reads back: each parameter's state at its offset, zeros
// in the alignment gaps, keyed by (param dtype, grad dtype).
TEST(MegatronGatheredTest, MadeObjectReadsBack) {
  const std::vector<GradBuffer> b = Buffers({{"a", DType::kFloat32, 3, false}, {"b", DType::kFloat32, 2, false}}, 1);
  auto bytes = [](size_t param, int state) -> ByteProducer {
    return [param, state](int64_t offset, int64_t length, uint8_t* dst) {
      for (int64_t i = 0; i < length / 4; ++i) {
        const float v = static_cast<float>(100 * state + 10 * param + offset / 4 + i);
        std::memcpy(dst + 4 * i, &v, 4);
      }
      return Status::Ok();
    };
  };
  const Value v = GatheredStateValue(b, [](DType) { return DType::kFloat32; }, bytes);
  Result<std::vector<GatheredBuffer>> read = ReadGatheredState(v, "test", "");
  ASSERT_TRUE(read.ok()) << read.status().message();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].numel_unpadded, 67);  // b at 0, a at 64
  const Tensor& exp_avg = *(*read)[0].states[1];
  std::vector<float> got(67);
  ASSERT_TRUE(exp_avg.storage->produce(0, 67 * 4, reinterpret_cast<uint8_t*>(got.data())).ok());
  EXPECT_EQ(got[0], 110.0f);  // b's first
  EXPECT_EQ(got[1], 111.0f);
  EXPECT_EQ(got[2], 0.0f);    // the gap
  EXPECT_EQ(got[64], 100.0f);  // a's first
  EXPECT_EQ(got[66], 102.0f);
}

TEST(MegatronGatheredTest, RefusesTheFormBeforeCoalescingAndWrongNumels) {
  Value legacy = Value::MakeDict();
  Set(legacy, "0", Value::MakeList({}));
  Result<std::vector<GatheredBuffer>> r = ReadGatheredState(legacy, "f.pt", "; fix");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("f.pt has no buckets_coalesced: True"), std::string::npos);
  EXPECT_NE(r.status().message().find("; fix"), std::string::npos);

  const std::vector<GradBuffer> b = Buffers({{"a", DType::kFloat32, 3, false}}, 1);
  Value v = GatheredStateValue(b, [](DType) { return DType::kFloat32; },
                               [](size_t, int) -> ByteProducer { return nullptr; });
  Value& states = MutableDictItems(v)->back().second;
  Set(MutableDictItems(states)->front().second, "numel_unpadded", Value::Int(4));
  r = ReadGatheredState(v, "f.pt", "");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("f.pt's grad buffer 0's 'param' is tensor(float32, [3]), not a flat fp32 "
                                      "tensor of its numel_unpadded 4"),
            std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace reshard
