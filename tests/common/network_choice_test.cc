// ChooseNetwork (src/common/net.h): the advertise address and interface `efdl run` picks, over
// fake interface lists and route lookups, and once against this machine's own interfaces.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/net.h"

namespace efdl {
namespace {

InterfaceAddress If(std::string name, std::string address, int prefix, bool loopback = false) {
  InterfaceAddress a;
  a.name = std::move(name);
  a.address = std::move(address);
  a.prefix_len = prefix;
  a.loopback = loopback;
  a.up = true;
  return a;
}

// A host with loopback, a management network (eth0), a training network (ib0) and IPv6 on
// eth0; names resolve through `names`, routes through `routes` (destination -> source).
struct FakeHost {
  std::vector<InterfaceAddress> interfaces = {
      If("lo", "127.0.0.1", 8, true), If("lo", "::1", 128, true),
      If("eth0", "192.168.1.10", 24), If("eth0", "fd00::10", 64), If("eth0", "fe80::1", 64),
      If("ib0", "10.20.0.10", 16)};
  std::map<std::string, std::vector<std::string>> names = {
      {"etcd.example", {"10.20.0.5"}},
      {"etcd6.example", {"fd00::5"}},
      {"trainer-1", {"127.0.1.1"}},          // a fresh Debian install's own name
      {"trainer-1.ib", {"10.20.0.10"}},
      {"other-host", {"10.20.0.11"}}};
  std::map<std::string, std::string> routes = {
      {"10.20.0.5", "10.20.0.10"},    // etcd on the training network: leaves from ib0
      {"192.168.1.5", "192.168.1.10"},
      {"fd00::5", "fd00::10"},
      {"10.20.0.10", "10.20.0.10"},   // a local address: the kernel picks itself
      {"127.0.1.1", "127.0.0.1"}};
  std::vector<std::string> route_queries;

  NetworkInputs Inputs(std::vector<std::string> etcd, std::string advertise = {},
                       std::string iface = {}) {
    NetworkInputs in;
    in.etcd_endpoints = std::move(etcd);
    in.advertise_addr = std::move(advertise);
    in.iface = std::move(iface);
    in.interfaces = interfaces;
    in.resolve = [this](const std::string& host) -> Result<std::vector<std::string>> {
      if (auto it = names.find(host); it != names.end()) return it->second;
      if (host.find_first_not_of("0123456789.") == std::string::npos ||
          host.find(':') != std::string::npos) {
        return std::vector<std::string>{host};   // a literal is itself
      }
      return Status::NotFound("cannot resolve host '" + host + "'");
    };
    in.route_source = [this](const std::string& addr, uint16_t) -> Result<std::string> {
      route_queries.push_back(addr);
      if (auto it = routes.find(addr); it != routes.end()) return it->second;
      return Status::Unavailable("no route to " + addr + ": Network is unreachable");
    };
    return in;
  }
};

std::string Message(const Result<NetworkChoice>& r) {
  return r.ok() ? "ok: " + r->address + " on " + r->iface : r.status().message();
}

TEST(ChooseNetworkTest, DefaultIsTheSourceAddressOfTheRouteToEtcdAndItsInterface) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "10.20.0.10");
  EXPECT_EQ(c->iface, "ib0");        // not eth0 (the first non-loopback interface)
  EXPECT_TRUE(c->warning.empty());
  EXPECT_NE(c->how.find("etcd"), std::string::npos);
  // Through the other network the route leaves from eth0.
  auto mgmt = ChooseNetwork(h.Inputs({"192.168.1.5:2379"}));
  ASSERT_TRUE(mgmt.ok()) << mgmt.status().ToString();
  EXPECT_EQ(mgmt->address, "192.168.1.10");
  EXPECT_EQ(mgmt->iface, "eth0");
}

TEST(ChooseNetworkTest, EtcdOnThisHostsOwnAddressStillAdvertisesThatAddress) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"10.20.0.10:2379"}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "10.20.0.10");
  EXPECT_EQ(c->iface, "ib0");        // the holder of the address, not the route's device (lo)
}

TEST(ChooseNetworkTest, LoopbackEtcdGivesLoopbackWithoutLookingUpRoutes) {
  for (const auto& etcd : std::vector<std::vector<std::string>>{
           {}, {"127.0.0.1:2379"}, {"localhost:2379", "127.0.0.2:2380"}, {"[::1]:2379"}}) {
    FakeHost h;
    auto c = ChooseNetwork(h.Inputs(etcd));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->address, "127.0.0.1");
    EXPECT_EQ(c->iface, "lo");
    EXPECT_TRUE(h.route_queries.empty());
  }
}

TEST(ChooseNetworkTest, NoRouteToAnyEndpointIsOneLineNamingEtcdAndTheFlags) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"172.16.0.1:2379", "172.16.0.2:2379"}));
  ASSERT_FALSE(c.ok()) << Message(c);
  EXPECT_TRUE(c.status().code() == Status::Code::kInvalidArgument);
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("172.16.0.1:2379,172.16.0.2:2379"), std::string::npos) << m;
  EXPECT_NE(m.find("Network is unreachable"), std::string::npos) << m;
  EXPECT_NE(m.find("--advertise-addr"), std::string::npos) << m;
  EXPECT_NE(m.find("--iface"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(h.route_queries, (std::vector<std::string>{"172.16.0.1", "172.16.0.2"}));
}

TEST(ChooseNetworkTest, TheFirstEndpointWithARouteWins) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"unresolvable.example:2379", "172.16.0.1:2379",
                                   "192.168.1.5:2379", "etcd.example:2379"}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "192.168.1.10");
  EXPECT_EQ(c->iface, "eth0");
}

TEST(ChooseNetworkTest, Ipv6EtcdGivesTheIpv6SourceAndIfaceKeepsTheRoutesFamily) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"[fd00::5]:2379"}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "fd00::10");
  EXPECT_EQ(c->iface, "eth0");
  auto by_name = ChooseNetwork(h.Inputs({"etcd6.example:2379"}));
  ASSERT_TRUE(by_name.ok()) << by_name.status().ToString();
  EXPECT_EQ(by_name->address, "fd00::10");
  // --iface eth0 with etcd over IPv6: eth0's global IPv6 address, never its link-local one.
  auto iface = ChooseNetwork(h.Inputs({"[fd00::5]:2379"}, "", "eth0"));
  ASSERT_TRUE(iface.ok()) << iface.status().ToString();
  EXPECT_EQ(iface->address, "fd00::10");
  // ... and with etcd over IPv4, its IPv4 address.
  auto iface4 = ChooseNetwork(h.Inputs({"192.168.1.5:2379"}, "", "eth0"));
  ASSERT_TRUE(iface4.ok()) << iface4.status().ToString();
  EXPECT_EQ(iface4->address, "192.168.1.10");
}

TEST(ChooseNetworkTest, IfaceOverridesTheRouteAndTakesItsOwnAddress) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "", "eth0"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "192.168.1.10");
  EXPECT_EQ(c->iface, "eth0");
  EXPECT_EQ(c->how, "--iface");
}

TEST(ChooseNetworkTest, AnInterfaceThisHostDoesNotHaveIsOneLineListingTheOnesItHas) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "", "eth7"));
  ASSERT_FALSE(c.ok()) << Message(c);
  EXPECT_TRUE(c.status().code() == Status::Code::kInvalidArgument);
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("--iface eth7"), std::string::npos) << m;
  EXPECT_NE(m.find("lo, eth0, ib0"), std::string::npos) << m;
  EXPECT_NE(m.find("EFDL_IFACE"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}

TEST(ChooseNetworkTest, IfaceLoWithRemoteEtcdIsRefused) {
  FakeHost h;
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "", "lo"));
  ASSERT_FALSE(c.ok()) << Message(c);
  EXPECT_NE(c.status().message().find("loopback"), std::string::npos) << Message(c);
  // With loopback etcd, lo is what a one-host job uses anyway.
  auto local = ChooseNetwork(h.Inputs({"127.0.0.1:2379"}, "", "lo"));
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ(local->address, "127.0.0.1");
}

TEST(ChooseNetworkTest, AdvertiseAddrMustBeThisHostsAndNamesBecomeNumeric) {
  FakeHost h;
  auto numeric = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "192.168.1.10"));
  ASSERT_TRUE(numeric.ok()) << numeric.status().ToString();
  EXPECT_EQ(numeric->address, "192.168.1.10");
  EXPECT_EQ(numeric->iface, "eth0");
  auto name = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "trainer-1.ib"));
  ASSERT_TRUE(name.ok()) << name.status().ToString();
  EXPECT_EQ(name->address, "10.20.0.10");   // MASTER_ADDR is numeric
  EXPECT_EQ(name->iface, "ib0");

  auto foreign = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "10.20.0.11"));
  ASSERT_FALSE(foreign.ok()) << Message(foreign);
  const std::string& m = foreign.status().message();
  EXPECT_NE(m.find("--advertise-addr 10.20.0.11 is not an address of this host"),
            std::string::npos) << m;
  EXPECT_NE(m.find("ib0 10.20.0.10"), std::string::npos) << m;
  auto foreign_name = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "other-host"));
  ASSERT_FALSE(foreign_name.ok()) << Message(foreign_name);
  EXPECT_NE(foreign_name.status().message().find("other-host (10.20.0.11)"), std::string::npos)
      << Message(foreign_name);
  auto unknown = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "nowhere.example"));
  ASSERT_FALSE(unknown.ok()) << Message(unknown);
  EXPECT_NE(unknown.status().message().find("does not resolve"), std::string::npos)
      << Message(unknown);
}

TEST(ChooseNetworkTest, AdvertisingTheDebianHostNameIsLoopbackAndSaysSo) {
  FakeHost h;
  // 127.0.1.1 is on lo (127.0.0.0/8), so it is this host's; with remote etcd a warning.
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "trainer-1"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, "127.0.1.1");
  EXPECT_EQ(c->iface, "lo");
  EXPECT_NE(c->warning.find("cannot reach"), std::string::npos) << c->warning;
  // etcd given by this host's own Debian name: reached over loopback, also a warning.
  auto own = ChooseNetwork(h.Inputs({"trainer-1:2379"}));
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  EXPECT_FALSE(own->warning.empty());
}

TEST(ChooseNetworkTest, AdvertiseAddrMustBelongToTheGivenIface) {
  FakeHost h;
  auto ok = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "10.20.0.10", "ib0"));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->address, "10.20.0.10");
  EXPECT_EQ(ok->iface, "ib0");
  auto mismatch = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "192.168.1.10", "ib0"));
  ASSERT_FALSE(mismatch.ok()) << Message(mismatch);
  EXPECT_NE(mismatch.status().message().find("is not an address of --iface ib0"),
            std::string::npos) << Message(mismatch);
}

TEST(ChooseNetworkTest, IfaceWithOnlyALinkLocalAddressIsRefused) {
  FakeHost h;
  h.interfaces.push_back(If("eth1", "fe80::2", 64));
  auto c = ChooseNetwork(h.Inputs({"etcd.example:2379"}, "", "eth1"));
  ASSERT_FALSE(c.ok()) << Message(c);
  EXPECT_NE(c.status().message().find("--iface eth1 has no address"), std::string::npos)
      << Message(c);
}

TEST(AllLoopbackTest, NamesAndAddressesOfLoopbackOnly) {
  EXPECT_TRUE(AllLoopback({}));
  EXPECT_TRUE(AllLoopback({"127.0.0.1:2379", "localhost:1", "[::1]:2379", "127.9.9.9:5"}));
  EXPECT_FALSE(AllLoopback({"127.0.0.1:2379", "10.0.0.1:2379"}));
  EXPECT_FALSE(AllLoopback({"[fd00::1]:2379"}));
  EXPECT_FALSE(AllLoopback({"etcd:2379"}));
}

// This machine: the route to a non-loopback address of one of its own interfaces leaves from
// that address (no packet is sent), and the choice with default flags is an address some
// interface here holds.
TEST(ChooseNetworkRealTest, ThisMachinesOwnInterfacesAndRoutes) {
  auto ifs = LocalInterfaceAddresses();
  ASSERT_TRUE(ifs.ok()) << ifs.status().ToString();
  bool has_lo = false;
  const InterfaceAddress* external = nullptr;
  for (const auto& ia : *ifs) {
    if (ia.address == "127.0.0.1") {
      has_lo = true;
      EXPECT_TRUE(ia.loopback);
      EXPECT_EQ(ia.prefix_len, 8);
    }
    if (!ia.loopback && ia.up && ia.address.find(':') == std::string::npos && !external) {
      external = &ia;
    }
  }
  ASSERT_TRUE(has_lo);
  auto src = SourceAddressFor("127.0.0.1", 2379);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  EXPECT_EQ(*src, "127.0.0.1");
  auto in = SystemNetworkInputs({"127.0.0.1:2379"}, "", "");
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  auto lo = ChooseNetwork(*in);
  ASSERT_TRUE(lo.ok()) << lo.status().ToString();
  EXPECT_EQ(lo->iface, "lo");
  auto missing = SystemNetworkInputs({"127.0.0.1:2379"}, "", "efdl-no-such-if0");
  ASSERT_TRUE(missing.ok());
  auto refused = ChooseNetwork(*missing);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("efdl-no-such-if0"), std::string::npos);
  if (external == nullptr) GTEST_SKIP() << "no non-loopback IPv4 interface here";
  auto own = SourceAddressFor(external->address, 2379);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  EXPECT_EQ(*own, external->address);
  auto remote = SystemNetworkInputs({external->address + ":2379"}, "", "");
  ASSERT_TRUE(remote.ok());
  auto c = ChooseNetwork(*remote);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->address, external->address);
  EXPECT_EQ(c->iface, external->name);
  // 203.0.113.0/24 (documentation) is not local: with a default route the source is a local
  // address of some interface; without one the lookup fails cleanly.
  auto doc = SourceAddressFor("203.0.113.7", 2379);
  if (doc.ok()) {
    bool held = false;
    for (const auto& ia : *ifs) held = held || ia.address == *doc;
    EXPECT_TRUE(held) << *doc;
  } else {
    EXPECT_TRUE(doc.status().code() == Status::Code::kUnavailable) << doc.status().ToString();
  }
}

}  // namespace
}  // namespace efdl
