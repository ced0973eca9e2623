// NumericAddresses and InterfaceOfAddress (src/common/net.h) on this machine's own interfaces:
// loopback is always there; addresses from the documentation ranges (RFC 5737) are never local.
#include "common/net.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

namespace efdl {
namespace {

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// True when the kernel lists ::1 on lo (IPv6 may be disabled in a container).
bool LoopbackHasIpv6() {
  std::ifstream in("/proc/net/if_inet6");
  std::string addr, index, prefix, scope, flags, name;
  while (in >> addr >> index >> prefix >> scope >> flags >> name) {
    if (name == "lo" && addr == "00000000000000000000000000000001") return true;
  }
  return false;
}

TEST(NumericAddressesTest, AnAddressLiteralIsItsOwnCanonicalText) {
  auto v4 = NumericAddresses("127.0.0.1");
  ASSERT_TRUE(v4.ok()) << v4.status().ToString();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1"});
  auto v6 = NumericAddresses("0:0:0:0:0:0:0:1");
  ASSERT_TRUE(v6.ok()) << v6.status().ToString();
  EXPECT_EQ(*v6, std::vector<std::string>{"::1"});
}

TEST(NumericAddressesTest, LocalhostResolvesToLoopbackOnce) {
  auto addrs = NumericAddresses("localhost");
  ASSERT_TRUE(addrs.ok()) << addrs.status().ToString();
  EXPECT_TRUE(Contains(*addrs, "127.0.0.1") || Contains(*addrs, "::1"));
  for (const auto& a : *addrs) EXPECT_EQ(std::count(addrs->begin(), addrs->end(), a), 1) << a;
}

TEST(NumericAddressesTest, UnknownNameIsNotFoundAndNamed) {
  auto r = NumericAddresses("no-such-host.invalid");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsNotFound()) << r.status().ToString();
  EXPECT_NE(r.status().message().find("no-such-host.invalid"), std::string::npos);
}

TEST(InterfaceOfAddressTest, LoopbackAddressAndNameAreOnLo) {
  auto by_address = InterfaceOfAddress("127.0.0.1");
  ASSERT_TRUE(by_address.ok()) << by_address.status().ToString();
  EXPECT_EQ(*by_address, "lo");
  auto by_name = InterfaceOfAddress("localhost");
  ASSERT_TRUE(by_name.ok()) << by_name.status().ToString();
  EXPECT_EQ(*by_name, "lo");
}

TEST(InterfaceOfAddressTest, Ipv6LoopbackIsOnLoWhateverItsSpelling) {
  if (!LoopbackHasIpv6()) GTEST_SKIP() << "no ::1 on lo here";
  for (const char* spelling : {"::1", "0:0:0:0:0:0:0:1", "0000::0001"}) {
    auto r = InterfaceOfAddress(spelling);
    ASSERT_TRUE(r.ok()) << spelling << ": " << r.status().ToString();
    EXPECT_EQ(*r, "lo") << spelling;
  }
}

TEST(InterfaceOfAddressTest, AnAddressNoInterfaceHoldsIsNotFoundAndNamed) {
  // Only 127.0.0.1 itself is an interface address, not the rest of 127/8.
  for (const char* host : {"203.0.113.7", "127.0.0.2", "2001:db8::1"}) {
    auto r = InterfaceOfAddress(host);
    ASSERT_FALSE(r.ok()) << host << " -> " << *r;
    EXPECT_TRUE(r.status().IsNotFound()) << r.status().ToString();
    EXPECT_NE(r.status().message().find(host), std::string::npos) << r.status().ToString();
  }
  auto unknown = InterfaceOfAddress("no-such-host.invalid");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(unknown.status().IsNotFound()) << unknown.status().ToString();
}

}  // namespace
}  // namespace efdl
