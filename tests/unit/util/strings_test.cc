#include "util/strings.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

TEST(Strings, Join) {
  EXPECT_EQ(Join({}, ", "), "");
  EXPECT_EQ(Join({"a"}, ", "), "a");
  EXPECT_EQ(Join({"a", "b", "c"}, ", "), "a, b, c");
  EXPECT_EQ(Join({"a", "", "c"}, "/"), "a//c");
  EXPECT_EQ(Join({"x", "y"}, ""), "xy");
}

TEST(Strings, Split) {
  using V = std::vector<std::string>;
  EXPECT_EQ(Split("", ','), V{""});
  EXPECT_EQ(Split("a", ','), V{"a"});
  EXPECT_EQ(Split("5,6,6,5", ','), (V{"5", "6", "6", "5"}));
  EXPECT_EQ(Split("a,,b,", ','), (V{"a", "", "b", ""}));
  EXPECT_EQ(Join(Split("x/y/z", '/'), "/"), "x/y/z");
}

TEST(Strings, EndsWith) {
  EXPECT_TRUE(EndsWith("__0_0.distcp", ".distcp"));
  EXPECT_TRUE(EndsWith(".distcp", ".distcp"));
  EXPECT_TRUE(EndsWith("a", ""));
  EXPECT_FALSE(EndsWith("distcp", ".distcp"));
  EXPECT_FALSE(EndsWith("a.distcp.tmp", ".distcp"));
}

TEST(Strings, ParseInt) {
  int64_t n = 0;
  EXPECT_TRUE(ParseInt("12", &n));
  EXPECT_EQ(n, 12);
  EXPECT_TRUE(ParseInt("-3", &n));
  EXPECT_EQ(n, -3);
  EXPECT_TRUE(ParseInt("9223372036854775807", &n));
  EXPECT_EQ(n, INT64_MAX);
  for (const char* bad : {"", "+1", "1e3", "12 ", " 12", "0x10", "args.n", "9223372036854775808"}) {
    EXPECT_FALSE(ParseInt(bad, &n)) << bad;
  }
}

TEST(Strings, EditDistance) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("split", "split"), 0u);
  EXPECT_EQ(EditDistance("spilt", "split"), 2u);   // a swap is two substitutions
  EXPECT_EQ(EditDistance("colum", "column"), 1u);  // insertion
  EXPECT_EQ(EditDistance("columnn", "column"), 1u);  // deletion
  EXPECT_EQ(EditDistance("row", "raw"), 1u);       // substitution
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("optimiser_groups", "optimizer_groups"), 1u);
}

TEST(Strings, HintSuggestsTheClosestWithinTwoEdits) {
  const std::vector<std::string> splits = {"column", "row", "vocab"};
  EXPECT_EQ(Hint("colum", splits), "did you mean 'column'?");
  EXPECT_EQ(Hint("rwo", splits), "did you mean 'row'?");
  EXPECT_EQ(Hint("vocab", splits), "did you mean 'vocab'?");
  // Ties go to the first allowed name.
  EXPECT_EQ(Hint("ab", {"abc", "abd"}), "did you mean 'abc'?");
  // The closest wins over an earlier, farther one.
  EXPECT_EQ(Hint("abcd", {"abxy", "abcx"}), "did you mean 'abcx'?");
}

TEST(Strings, ClosestNameIgnoresCase) {
  const std::vector<std::string> formats = {"deepspeed", "hf", "torch_dist", "torchtitan"};
  ASSERT_NE(ClosestName("HF", formats), nullptr);
  EXPECT_EQ(*ClosestName("HF", formats), "hf");
  EXPECT_EQ(*ClosestName("TORCH_DIST", formats), "torch_dist");  // ten letters of another case: no edit
  EXPECT_EQ(*ClosestName("torchdist", formats), "torch_dist");
  EXPECT_EQ(*ClosestName("DeepSpeed", formats), "deepspeed");
  EXPECT_EQ(ClosestName("parquet", formats), nullptr);
  EXPECT_EQ(Hint("TORCHTITAN", formats), "did you mean 'torchtitan'?");
}

TEST(Strings, ClosestNameTakesADashForAnUnderscore) {
  const std::vector<std::string> paths = {"args.num_attention_heads", "args.num_key_value_heads"};
  ASSERT_NE(ClosestName("args.num-attention-heads", paths), nullptr);
  EXPECT_EQ(*ClosestName("args.num-attention-heads", paths), "args.num_attention_heads");
  EXPECT_EQ(*ClosestName("torch-dist", {"hf", "torch_dist"}), "torch_dist");
}

TEST(Strings, HintListsEverythingForAFarName) {
  EXPECT_EQ(Hint("diagonal", {"column", "row", "vocab"}), "expected one of: column, row, vocab");
  EXPECT_EQ(Hint("abc", {"xyz"}), "expected one of: xyz");  // three edits is not a typo
}

TEST(StringsTest, CountSaysOneWithoutPlural) {
  EXPECT_EQ(Count(1, "block"), "1 block");
  EXPECT_EQ(Count(0, "block"), "0 blocks");
  EXPECT_EQ(Count(3, "KV head"), "3 KV heads");
}

}  // namespace
}  // namespace reshard
