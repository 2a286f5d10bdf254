#include "reshard/status.h"

#include <gtest/gtest.h>

namespace reshard {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidInput("odd number " + std::to_string(x));
  return x / 2;
}

Status UseHalf(int x, int* out) {
  RESHARD_ASSIGN_OR_RETURN(int h, Half(x));
  *out = h;
  return Status::Ok();
}

TEST(StatusTest, ResultCarriesValueOrError) {
  EXPECT_EQ(*Half(8), 4);
  Result<int> bad = Half(3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Status::Code::kInvalidInput);
  EXPECT_EQ(bad.status().message(), "odd number 3");
}

TEST(StatusTest, AssignOrReturnPropagates) {
  int out = 0;
  EXPECT_TRUE(UseHalf(10, &out).ok());
  EXPECT_EQ(out, 5);
  Status st = UseHalf(7, &out);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.WithContext("file x").message(), "file x: odd number 7");
}

}  // namespace
}  // namespace reshard
