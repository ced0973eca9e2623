// Pure logic of the etcd client: endpoint parsing and prefix ranges.
#include <gtest/gtest.h>

#include "efdl/etcd.h"

namespace efdl::etcd {
namespace {

TEST(ParseEndpoints, AcceptsListsWithSchemesSpacesAndIpv6) {
  auto parsed = ParseEndpoints("127.0.0.1:2379, http://localhost:22379/,[::1]:2380");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, (std::vector<std::string>{"127.0.0.1:2379", "localhost:22379", "[::1]:2380"}));
}

TEST(ParseEndpoints, RejectsMalformedEntriesNamingThem) {
  struct Case {
    const char* spec;
    const char* named;
  };
  for (const Case& c : {Case{"", "no etcd endpoints"},
                        Case{"127.0.0.1", "'127.0.0.1' has no port"},
                        Case{"127.0.0.1:", "invalid port ''"},
                        Case{"host:abc", "invalid port 'abc'"},
                        Case{"host:70000", "invalid port '70000'"},
                        Case{"host:0", "invalid port '0'"},
                        Case{":2379", "has no host"}, Case{"a:1,,b:2", "empty entry"},
                        Case{"https://h:1", "TLS is turned on by --etcd-cacert"},
                        Case{"::1:2379", "write IPv6 addresses as [addr]:port"},
                        Case{"[::1]2379", "malformed"}}) {
    auto parsed = ParseEndpoints(c.spec);
    ASSERT_FALSE(parsed.ok()) << c.spec;
    EXPECT_EQ(parsed.status().code(), Status::Code::kInvalidArgument) << c.spec;
    EXPECT_NE(parsed.status().message().find(c.named), std::string::npos)
        << c.spec << " -> " << parsed.status().message();
  }
}

TEST(PrefixRangeEnd, IncrementsLastByteAndCarriesOverFF) {
  EXPECT_EQ(PrefixRangeEnd("/job/a"), "/job/b");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(PrefixRangeEnd(std::string("\xff\xff", 2)), std::string(1, '\0'));
}

TEST(Connect, RejectsEmptyEndpointListWithoutNetwork) {
  auto client = Connect(ClientOptions{});
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace efdl::etcd
