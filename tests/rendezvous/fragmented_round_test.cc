// Fragmented rounds (`efdl run --world-size N`): the planner's choice of members (PlanRound with
// plan::ChooseFragmentMembers) and the rendezvous around it on the in-memory etcd: rounds form
// only at exactly N processes, newcomers to a round that adds up wait as standbys, and a member
// that leaves is replaced by standbys with the survivors keeping their ranks.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/protocol.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "support/memory_etcd.h"
#include "support/rendezvous_events.h"

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;
using testing::MemoryEtcd;

std::vector<std::string> MemberIds(const Plan& p) {
  std::vector<std::string> out;
  for (const auto& m : p.members) out.push_back(m.id);
  return out;
}

std::vector<int> Offsets(const Plan& p) {
  std::vector<int> out;
  for (const auto& m : p.members) out.push_back(m.rank_offset);
  return out;
}

TEST(FragmentedPlanTest, OnePlusTwoFormsWhereAJoinOrderPrefixWouldNot) {
  // Join order a(1), b(1), c(2): the prefix a+b leaves no room for c; 1 + 2 uses fewer nodes.
  Plan p = PlanRound({{"a", 1, 1, "ha", 11}, {"b", 2, 1, "hb", 12}, {"c", 3, 2, "hc", 13}}, {},
                     {1, 3, 3});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(MemberIds(p), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(Offsets(p), (std::vector<int>{0, 1}));
  EXPECT_EQ(p.standbys, (std::vector<std::string>{"b"}));
  EXPECT_EQ(p.world_size, 3);
  EXPECT_EQ(p.master_addr, "ha");
  EXPECT_EQ(p.master_port, 11);
}

TEST(FragmentedPlanTest, LargerNodesWinAmongEquallyFewAndRanksAreContiguousPerNode) {
  // 8 = 3 + 5 = 6 + 2: both two nodes; 6 + 2 keeps the larger node (rule 2).
  Plan p = PlanRound({{"a", 1, 3, "", 0}, {"b", 2, 6, "", 0}, {"c", 3, 5, "", 0},
                      {"d", 4, 2, "", 0}}, {}, {1, 4, 8});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(MemberIds(p), (std::vector<std::string>{"b", "d"}));
  EXPECT_EQ(Offsets(p), (std::vector<int>{0, 6}));
  EXPECT_EQ(p.standbys, (std::vector<std::string>{"a", "c"}));
}

TEST(FragmentedPlanTest, PreviousMembersStayAndKeepTheirRelativeOrder) {
  // b (node rank 0) and a (1) ran; c joined since and fits as well as a does: a stays.
  Plan p = PlanRound({{"a", 1, 1, "", 0}, {"b", 2, 2, "", 0}, {"c", 3, 1, "", 0}},
                     {{"b", 0}, {"a", 1}}, {1, 3, 3});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(MemberIds(p), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(Offsets(p), (std::vector<int>{0, 2}));
  EXPECT_EQ(p.standbys, (std::vector<std::string>{"c"}));
}

TEST(FragmentedPlanTest, TwoProcessNodeReplacedByTwoOneProcessNodes) {
  // b(2) is gone; the survivor a keeps rank 0, the standbys follow in join order.
  Plan p = PlanRound({{"d", 9, 1, "", 0}, {"a", 1, 1, "", 0}, {"c", 7, 1, "", 0}}, {{"a", 0}},
                     {1, 3, 3});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(MemberIds(p), (std::vector<std::string>{"a", "c", "d"}));
  EXPECT_EQ(Offsets(p), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(p.standbys.empty());
}

TEST(FragmentedPlanTest, NotFormedWhenNothingAddsUpOrTheNodeCountIsOutOfRange) {
  Plan none = PlanRound({{"a", 1, 2, "", 0}, {"b", 2, 2, "", 0}}, {}, {1, 3, 3});
  EXPECT_FALSE(none.formed);
  EXPECT_TRUE(none.members.empty());
  EXPECT_EQ(none.standbys, (std::vector<std::string>{"a", "b"}));
  // Only 1 + 1 + 1 adds up, but at most 2 nodes may take part.
  std::vector<Candidate> ones = {{"a", 1, 1, "", 0}, {"b", 2, 1, "", 0}, {"c", 3, 1, "", 0}};
  EXPECT_FALSE(PlanRound(ones, {}, {1, 2, 3}).formed);
  EXPECT_TRUE(PlanRound(ones, {}, {1, 3, 3}).formed);
  // One 3-process node adds up, but at least 2 nodes are required.
  EXPECT_FALSE(PlanRound({{"a", 1, 3, "", 0}}, {}, {2, 3, 3}).formed);
  EXPECT_FALSE(PlanRound({}, {}, {1, 3, 3}).formed);
}

RendezvousOptions FragOpts(const std::string& node, int nproc) {
  RendezvousOptions o = testing::FastRendezvousOptions("fragjob", node, 1, 3);
  o.nproc = nproc;
  o.world_size = 3;
  return o;
}

struct FragNode {
  FragNode(MemoryEtcd& db, RendezvousOptions o) : id(o.node_id) {
    rdzv = NewEtcdRendezvous(db, std::move(o));
    Status s = rdzv->Join();
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  // The next event of `type` within `timeout` (other events on the way are skipped).
  std::optional<Event> Next(Event::Type type, std::chrono::milliseconds timeout = 5s) {
    return testing::NextEvent(*rdzv, type, timeout);
  }
  std::optional<Event> Started(std::chrono::milliseconds timeout = 5s) {
    return Next(Event::Type::kRoundStarted, timeout);
  }
  std::string id;
  std::unique_ptr<Rendezvous> rdzv;
};

TEST(FragmentedRendezvousTest, NodesThatDoNotAddUpWaitUntilOneThatMakesItJoins) {
  MemoryEtcd db;
  FragNode a(db, FragOpts("a", 2));
  FragNode b(db, FragOpts("b", 2));
  EXPECT_FALSE(a.Started(1500ms)) << "2 + 2 processes must not form a round of world size 3";
  FragNode c(db, FragOpts("c", 1));
  auto ea = a.Started(), eb = b.Started(), ec = c.Started();
  ASSERT_TRUE(ea && eb && ec);
  EXPECT_FALSE(ea->assignment.standby);
  EXPECT_EQ(ea->assignment.rank_offset, 0);
  EXPECT_EQ(ea->assignment.nproc, 2);
  EXPECT_TRUE(eb->assignment.standby);
  EXPECT_FALSE(ec->assignment.standby);
  EXPECT_EQ(ec->assignment.node_rank, 1);
  EXPECT_EQ(ec->assignment.rank_offset, 2);
  EXPECT_EQ(ec->assignment.world_size, 3);
  EXPECT_EQ(ec->assignment.nnodes, 2);
  EXPECT_EQ(ec->assignment.master_port, ea->assignment.master_port);
}

TEST(FragmentedRendezvousTest, TwoProcessNodeIsReplacedByTwoStandbysWithStableRanks) {
  MemoryEtcd db;
  FragNode a(db, FragOpts("a", 1));
  FragNode b(db, FragOpts("b", 2));
  auto ea = a.Started(), eb = b.Started();
  ASSERT_TRUE(ea && eb);
  EXPECT_EQ(ea->assignment.world_size, 3);
  EXPECT_EQ(eb->assignment.rank_offset, 1);

  // Newcomers to a round that adds up wait; the running round is not disturbed.
  FragNode c(db, FragOpts("c", 1));
  FragNode d(db, FragOpts("d", 1));
  auto sc = c.Started(), sd = d.Started();
  ASSERT_TRUE(sc && sd);
  EXPECT_TRUE(sc->assignment.standby);
  EXPECT_TRUE(sd->assignment.standby);
  EXPECT_NE(sc->message.find("add up"), std::string::npos) << sc->message;
  EXPECT_FALSE(a.Next(Event::Type::kRoundClosing, 700ms));

  b.rdzv->Leave();
  auto a2 = a.Started(), c2 = c.Started(), d2 = d.Started();
  ASSERT_TRUE(a2 && c2 && d2);
  EXPECT_GT(a2->round, ea->round);
  for (const auto* e : {&a2, &c2, &d2}) {
    EXPECT_FALSE((*e)->assignment.standby);
    EXPECT_EQ((*e)->assignment.world_size, 3);
    EXPECT_EQ((*e)->assignment.nnodes, 3);
    EXPECT_EQ((*e)->round, a2->round);
  }
  EXPECT_EQ(a2->assignment.node_rank, 0);
  EXPECT_EQ(a2->assignment.rank_offset, 0);
  EXPECT_EQ(c2->assignment.rank_offset, 1);
  EXPECT_EQ(d2->assignment.rank_offset, 2);
}

}  // namespace
}  // namespace efdl::rdzv
