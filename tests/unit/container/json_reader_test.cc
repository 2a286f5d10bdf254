// JSON as Values: every kind, escapes, and the refusals that keep a damaged
// or hostile header from being read as something else.
#include "container/json_reader.h"

#include <gtest/gtest.h>

#include <string>

namespace reshard {
namespace {

Value Parsed(const std::string& text) {
  Result<Value> v = ParseJson(text, "test.json");
  EXPECT_TRUE(v.ok()) << v.status().message();
  return v.ok() ? *v : Value::None();
}

std::string Refusal(const std::string& text) {
  Result<Value> v = ParseJson(text, "test.json");
  EXPECT_FALSE(v.ok()) << text;
  return v.ok() ? "" : v.status().message();
}

TEST(JsonReaderTest, ReadsEveryKindKeepingKeyOrder) {
  const Value v = Parsed(R"( {"b": 1, "a": [true, false, null, -2.5e-3, "x"], "c": {}, "d": 12345678901234} )");
  const Items& items = *DictItems(v);
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(items[0].first.as_string(), "b");
  EXPECT_EQ(items[1].first.as_string(), "a");
  EXPECT_EQ(Find(v, "b")->as_int(), 1);
  EXPECT_EQ(Find(v, "d")->as_int(), 12345678901234);
  const std::vector<Value>& list = Find(v, "a")->as_list().items;
  ASSERT_EQ(list.size(), 5u);
  EXPECT_TRUE(list[0].as_bool());
  EXPECT_FALSE(list[1].as_bool());
  EXPECT_TRUE(list[2].is_none());
  EXPECT_DOUBLE_EQ(list[3].as_float(), -2.5e-3);
  EXPECT_EQ(list[4].as_string(), "x");
  EXPECT_TRUE(DictItems(*Find(v, "c"))->empty());
}

TEST(JsonReaderTest, NumbersThatAreNotIntegersAreFloats) {
  EXPECT_TRUE(Parsed("1.0").is(Value::Kind::kFloat));
  EXPECT_TRUE(Parsed("1e5").is(Value::Kind::kFloat));
  EXPECT_TRUE(Parsed("-0").is(Value::Kind::kInt));
  EXPECT_TRUE(Parsed("99999999999999999999").is(Value::Kind::kFloat));  // beyond 64 bits
}

TEST(JsonReaderTest, DecodesEscapesToUtf8) {
  EXPECT_EQ(Parsed(R"("a\"b\\c\/d\n\t")").as_string(), "a\"b\\c/d\n\t");
  EXPECT_EQ(Parsed(R"("\u00e9\u20ac")").as_string(), "\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(Parsed(R"("\ud83d\ude00")").as_string(), "\xF0\x9F\x98\x80");  // a surrogate pair
}

TEST(JsonReaderTest, RefusesWhatIsNotStrictJson) {
  EXPECT_NE(Refusal(R"({"a": 1,})").find("test.json is not valid JSON"), std::string::npos);
  Refusal("{'a': 1}");
  Refusal("[1 2]");
  Refusal("01");
  Refusal("1.");
  Refusal("nan");
  Refusal("\"unterminated");
  Refusal("\"tab\there\"");
  Refusal("\"\\x\"");
  Refusal("{} extra");
  Refusal("");
  Refusal(R"("\ud83d\u0041")");
}

TEST(JsonReaderTest, RefusesAKeyGivenTwice) {
  EXPECT_NE(Refusal(R"({"w": {"dtype": "F32"}, "w": {"dtype": "BF16"}})").find("key \"w\" given twice"),
            std::string::npos);
}

TEST(JsonReaderTest, RefusesDeepNesting) {
  EXPECT_TRUE(ParseJson(std::string(64, '[') + std::string(64, ']'), "ok").ok());
  EXPECT_NE(Refusal(std::string(100000, '[')).find("nesting deeper than 64"), std::string::npos);
}

}  // namespace
}  // namespace reshard
