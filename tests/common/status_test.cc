#include "efdl/status.h"

#include <gtest/gtest.h>

namespace efdl {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  EFDL_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(StatusTest, OkAndErrorsFormat) {
  EXPECT_TRUE(Status::OK().ok());
  EXPECT_EQ(Status::OK().ToString(), "OK");
  Status s = Status::Unavailable("etcd at 127.0.0.1:1 is down");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.IsUnavailable());
  EXPECT_EQ(s.ToString(), "Unavailable: etcd at 127.0.0.1:1 is down");
  EXPECT_EQ(s.WithContext("put /a").message(), "put /a: etcd at 127.0.0.1:1 is down");
}

TEST(StatusTest, ResultPropagatesFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd");
  EXPECT_EQ(Quarter(6).value_or(-1), -1);
}

}  // namespace
}  // namespace efdl
