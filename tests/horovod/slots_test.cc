#include "horovod/slots.h"

#include <map>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

namespace efdl::horovod {
namespace {

std::vector<SlotInfo> MustAssign(const std::vector<HostSlots>& hosts) {
  auto r = AssignSlots(hosts);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::vector<SlotInfo>{};
}

TEST(HorovodSlotsTest, UnevenHostsGetHorovodCrossRanks) {
  // a:2, b:1, c:3 -> cross_0 = {a,b,c}, cross_1 = {a,c}, cross_2 = {c}.
  auto s = MustAssign({{"a", 2}, {"b", 1}, {"c", 3}});
  ASSERT_EQ(s.size(), 6u);
  std::vector<SlotInfo> want = {
      {"a", 0, 6, 0, 2, 0, 3}, {"a", 1, 6, 1, 2, 0, 2}, {"b", 2, 6, 0, 1, 1, 3},
      {"c", 3, 6, 0, 3, 2, 3}, {"c", 4, 6, 1, 3, 1, 2}, {"c", 5, 6, 2, 3, 0, 1},
  };
  EXPECT_EQ(s, want);
}

TEST(HorovodSlotsTest, SingleHostIsItsOwnCrossGroupOfOne) {
  auto s = MustAssign({{"only", 4}});
  ASSERT_EQ(s.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s[i], (SlotInfo{"only", i, 4, i, 4, 0, 1}));
  }
}

TEST(HorovodSlotsTest, InvariantsHoldForManyLayouts) {
  // For every layout of up to 4 hosts with 1..4 slots: ranks are 0..size-1 in host order, each
  // (scope, rank-in-scope) pair is unique and every scope's ranks are 0..scope_size-1.
  for (int code = 0; code < 4 * 4 * 4 * 4 + 4 * 4 * 4 + 4 * 4 + 4; ++code) {
    std::vector<HostSlots> hosts;
    int c = code;
    int n = 1 + c % 4;
    c /= 4;
    for (int h = 0; h < n; ++h, c /= 4) hosts.push_back({"h" + std::to_string(h), 1 + c % 4});
    auto slots = MustAssign(hosts);
    std::map<std::string, std::set<int>> scope_ranks;
    std::map<std::string, int> scope_size;
    int expect_rank = 0;
    for (const auto& s : slots) {
      EXPECT_EQ(s.rank, expect_rank++);
      EXPECT_EQ(s.size, static_cast<int>(slots.size()));
      for (auto [scope, r, sz] : {std::tuple{std::string("global"), s.rank, s.size},
                                  std::tuple{"local_" + s.hostname, s.local_rank, s.local_size},
                                  std::tuple{"cross_" + std::to_string(s.local_rank),
                                             s.cross_rank, s.cross_size}}) {
        EXPECT_TRUE(scope_ranks[scope].insert(r).second) << scope << " rank " << r;
        if (scope_size.count(scope)) {
          EXPECT_EQ(scope_size[scope], sz) << scope;
        }
        scope_size[scope] = sz;
      }
    }
    for (const auto& [scope, ranks] : scope_ranks) {
      EXPECT_EQ(static_cast<int>(ranks.size()), scope_size[scope]) << scope;
      EXPECT_EQ(*ranks.rbegin(), scope_size[scope] - 1) << scope;
    }
  }
}

TEST(HorovodSlotsTest, RejectsBadRounds) {
  EXPECT_FALSE(AssignSlots({}).ok());
  EXPECT_FALSE(AssignSlots({{"a", 0}}).ok());
  EXPECT_FALSE(AssignSlots({{"a", 1}, {"a", 2}}).ok());
  EXPECT_FALSE(AssignSlots({{"", 1}}).ok());
  auto slash = AssignSlots({{"a/b", 1}});
  ASSERT_FALSE(slash.ok());
  EXPECT_NE(slash.status().message().find("'/'"), std::string::npos) << slash.status().message();
  EXPECT_FALSE(AssignSlots({{"a:1", 1}}).ok());
  EXPECT_FALSE(AssignSlots({{std::string(300, 'x'), 1}}).ok());
  EXPECT_TRUE(AssignSlots({{"node-1.rack_2", 1}}).ok());
}

TEST(HorovodSlotsTest, ResponseStringAndRemovedSlot) {
  EXPECT_EQ((SlotInfo{"a", 4, 6, 1, 2, 1, 3}).ToResponseString(), "4,6,1,2,1,3");
  EXPECT_EQ(RemovedSlot().ToResponseString(), "-1,-1,-1,-1,-1,-1");
}

TEST(HorovodWorkerEnvTest, GivesEachLocalProcessItsVariables) {
  WorkerEnvOptions o;
  o.rendezvous_addr = "10.0.0.5";
  o.rendezvous_port = 4242;
  o.rendezvous_token = "0123456789abcdef0123456789abcdef";
  auto env = WorkerEnvForHost({{"a", 2}, {"b", 1}, {"c", 3}}, 2, o);
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  ASSERT_EQ(env->size(), 3u);
  EnvMap want{
      {"HOROVOD_HOSTNAME", "c"},          {"HOROVOD_RANK", "4"},
      {"HOROVOD_SIZE", "6"},              {"HOROVOD_LOCAL_RANK", "1"},
      {"HOROVOD_LOCAL_SIZE", "3"},        {"HOROVOD_CROSS_RANK", "1"},
      {"HOROVOD_CROSS_SIZE", "2"},        {"HOROVOD_CONTROLLER", "gloo"},
      {"HOROVOD_CPU_OPERATIONS", "gloo"}, {"HOROVOD_GLOO_RENDEZVOUS_ADDR",
                                           "10.0.0.5:4242/0123456789abcdef0123456789abcdef"},
      {"HOROVOD_GLOO_RENDEZVOUS_PORT", "4242"},
  };
  EXPECT_EQ((*env)[1], want);
  EXPECT_EQ((*env)[0].at("HOROVOD_RANK"), "3");
  EXPECT_EQ((*env)[2].at("HOROVOD_CROSS_SIZE"), "1");
  EXPECT_EQ((*env)[0].count("HOROVOD_ELASTIC"), 0u);
}

TEST(HorovodWorkerEnvTest, OptionalVariables) {
  WorkerEnvOptions o;
  o.rendezvous_addr = "127.0.0.1";
  o.rendezvous_port = 1;
  o.rendezvous_token = "0123456789abcdef0123456789abcdef";
  o.elastic = true;
  o.gloo_iface = "lo";
  o.gloo_timeout_seconds = 60;
  auto env = WorkerEnvForHost({{"a", 1}}, 0, o);
  ASSERT_TRUE(env.ok());
  EXPECT_EQ((*env)[0].at("HOROVOD_ELASTIC"), "1");
  EXPECT_EQ((*env)[0].at("HOROVOD_GLOO_IFACE"), "lo");
  EXPECT_EQ((*env)[0].at("HOROVOD_GLOO_TIMEOUT_SECONDS"), "60");
}

TEST(HorovodWorkerEnvTest, RejectsBadInput) {
  WorkerEnvOptions o;
  o.rendezvous_addr = "127.0.0.1";
  o.rendezvous_port = 1;
  o.rendezvous_token = "0123456789abcdef0123456789abcdef";
  EXPECT_FALSE(WorkerEnvForHost({{"a", 1}}, 1, o).ok());
  EXPECT_FALSE(WorkerEnvForHost({{"a", 1}, {"a", 1}}, 0, o).ok());
  o.rendezvous_port = 0;
  EXPECT_FALSE(WorkerEnvForHost({{"a", 1}}, 0, o).ok());
  o.rendezvous_port = 1;
  o.rendezvous_token.clear();  // fail closed: the server would refuse every request
  EXPECT_FALSE(WorkerEnvForHost({{"a", 1}}, 0, o).ok());
  SlotInfo slot{"a", 0, 1, 0, 1, 0, 1};
  EXPECT_EQ(WorkerEnv(slot, o).count("HOROVOD_GLOO_RENDEZVOUS_ADDR"), 0u);
}

}  // namespace
}  // namespace efdl::horovod
