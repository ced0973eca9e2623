#include "rendezvous/protocol.h"

#include <gtest/gtest.h>

namespace efdl::rdzv {
namespace {

std::vector<std::string> Ids(const Plan& p) {
  std::vector<std::string> out;
  for (const auto& m : p.members) out.push_back(m.id);
  return out;
}

TEST(PlanRoundTest, FirstRoundOrdersByJoinAndOffsetsRanksByNproc) {
  Plan p = PlanRound({{"c", 30, 2, "hc", 3}, {"a", 10, 3, "ha", 1}, {"b", 20, 5, "hb", 2}}, {},
                     {1, 3, 0});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(Ids(p), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(p.members[1].rank_offset, 3);
  EXPECT_EQ(p.members[2].rank_offset, 8);
  EXPECT_EQ(p.world_size, 10);
  EXPECT_EQ(p.master_addr, "ha");
  EXPECT_EQ(p.master_port, 1);
}

TEST(PlanRoundTest, PreviousMembersKeepOrderAndJoinersGoLast) {
  // "old" joined first but was left out of the last round: it comes back after the members.
  Plan p = PlanRound({{"old", 1, 1, "", 0}, {"x", 5, 1, "", 0}, {"y", 3, 1, "", 0},
                      {"new", 9, 1, "", 0}},
                     {{"y", 0}, {"x", 1}}, {1, 8, 0});
  EXPECT_EQ(Ids(p), (std::vector<std::string>{"y", "x", "old", "new"}));
}

TEST(PlanRoundTest, BeyondMaxAreStandbysAndBelowMinIsNotFormed) {
  Plan p = PlanRound({{"a", 1, 1, "", 0}, {"b", 2, 1, "", 0}, {"c", 3, 1, "", 0}}, {}, {2, 2, 0});
  ASSERT_TRUE(p.formed);
  EXPECT_EQ(p.standbys, (std::vector<std::string>{"c"}));
  EXPECT_FALSE(PlanRound({{"a", 1, 1, "", 0}}, {}, {2, 3, 0}).formed);
  EXPECT_FALSE(PlanRound({}, {}, {1, 3, 0}).formed);
}

TEST(PlanRoundTest, FragmentedModeNeedsExactWorldSize) {
  PlanLimits limits{1, 4, 8};
  Plan p = PlanRound({{"a", 1, 3, "", 0}, {"b", 2, 6, "", 0}, {"c", 3, 5, "", 0}}, {}, limits);
  ASSERT_TRUE(p.formed);  // 3 + 5: b does not fit and waits
  EXPECT_EQ(Ids(p), (std::vector<std::string>{"a", "c"}));
  EXPECT_FALSE(PlanRound({{"a", 1, 3, "", 0}}, {}, limits).formed);
}

TEST(RecordsTest, NodeRecordCarriesItsProgramWhenGiven) {
  const NodeRecord with{"10.0.0.2", 4, "train.py", ""};
  const NodeRecord without{"10.0.0.2", 4, "", ""};
  auto back = NodeRecord::Decode(with.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->program, "train.py");
  EXPECT_EQ(without.Encode(), R"({"addr":"10.0.0.2","nproc":4})");
  auto old = NodeRecord::Decode(R"({"addr":"10.0.0.2","nproc":4})");
  ASSERT_TRUE(old.ok());
  EXPECT_TRUE(old->program.empty());
  EXPECT_FALSE(NodeRecord::Decode(R"({"addr":"a","nproc":1,"prog":7})").ok());
}

TEST(RecordsTest, GaveUpRecordCarriesTheFailingRanksLastStderrLines) {
  GaveUpRecord g{"rank 1 exited with status 1 in round 2", "2026-12-04T14:00:00Z",
                 {"Traceback (most recent call last):", "ValueError: bad \xff byte"}};
  auto back = GaveUpRecord::Decode(g.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->reason, g.reason);
  ASSERT_EQ(back->stderr_tail.size(), 2u);
  EXPECT_EQ(back->stderr_tail[0], "Traceback (most recent call last):");
  EXPECT_EQ(back->stderr_tail[1].substr(0, 16), "ValueError: bad ");  // the bad byte replaced
  // A record of an agent before the field, and one whose field is not a list of strings.
  auto old = GaveUpRecord::Decode(R"({"reason":"r","t":"x"})");
  ASSERT_TRUE(old.ok());
  EXPECT_TRUE(old->stderr_tail.empty());
  EXPECT_FALSE(GaveUpRecord::Decode(R"({"reason":"r","stderr":[1]})").ok());
  EXPECT_FALSE(GaveUpRecord::Decode(R"({"reason":"r","stderr":"line"})").ok());
}

TEST(RecordsTest, AnAckCarriesTheNodesOutcomeOfItsLastRoundAndAnAssignmentTheEarlyExit) {
  AckRecord ack{6, AckState::kAck, 29500, 0};
  EXPECT_EQ(ack.Encode().find("\"po\""), std::string::npos);   // nothing to tell: no fields
  ack.prev_round = 5;
  ack.prev_outcome = kOutcomeDone;
  ack.prev_detail = "ranks 2..3";
  auto back = AckRecord::Decode(ack.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->prev_round, 5);
  EXPECT_EQ(back->prev_outcome, "done");
  EXPECT_EQ(back->prev_detail, "ranks 2..3");
  for (const char* bad : {R"({"r":1,"st":"ack","po":"crashed"})",
                          R"({"r":1,"st":"ack","pr":"5","po":"lost"})",
                          R"({"r":1,"st":"ack","po":"lost","pd":7})"}) {
    EXPECT_FALSE(AckRecord::Decode(bad).ok()) << bad;
  }
  AssignRecord a{6, 1, 1, false};
  EXPECT_FALSE(AssignRecord::Decode(a.Encode())->early_exit);
  a.early_exit = true;
  EXPECT_TRUE(AssignRecord::Decode(a.Encode())->early_exit);
  EXPECT_FALSE(AssignRecord::Decode(R"({"r":1,"sb":true,"ee":1})").ok());
}

// An active round's record as the coordinator writes it (RecordsTest's two round trips).
RoundRecord ActiveRound7() {
  return {.round = 7, .phase = Phase::kActive, .coordinator = "n1", .deputies = {"n2", "n3"},
          .world_size = 12, .nnodes = 3, .master_addr = "10.0.0.1", .master_port = 29500,
          .message = {}};
}

TEST(RecordsTest, RoundTripAndRejectGarbage) {
  RoundRecord r = ActiveRound7();
  auto back = RoundRecord::Decode(r.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->round, 7);
  EXPECT_EQ(back->phase, Phase::kActive);
  EXPECT_EQ(back->deputies, r.deputies);
  EXPECT_EQ(back->master_port, 29500);
  EXPECT_LT(r.Encode().size(), 200u);  // every node watches it: it must stay small
  EXPECT_FALSE(RoundRecord::Decode("not json").ok());
  EXPECT_FALSE(RoundRecord::Decode(R"({"r":1,"ph":"dancing"})").ok());
  auto ack = AckRecord::Decode(AckRecord{3, AckState::kDone, 0, 2}.Encode());
  ASSERT_TRUE(ack.ok());
  EXPECT_EQ(ack->state, AckState::kDone);
  EXPECT_EQ(ack->restarts, 2);
  EXPECT_FALSE(NodeRecord::Decode(R"({"addr":"h","nproc":0})").ok());
}

TEST(ValidateIdTest, RejectsWhatEtcdKeysAndPathsCannotTake) {
  EXPECT_TRUE(ValidateId("job id", "job-1_a.b").ok());
  Status s = ValidateId("job id", "a/b");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("job id 'a/b' is not valid"), std::string::npos);
  EXPECT_FALSE(ValidateId("job id", ".hidden").ok());
  EXPECT_FALSE(ValidateId("job id", "-x").ok());
  EXPECT_FALSE(ValidateId("node id", "").ok());
  EXPECT_FALSE(ValidateId("node id", std::string(200, 'x')).ok());
}

// Horovod: the cross communicator of local rank l joins local rank l of every node that has
// one; ranks in node order. Hosts a:1, b:2, c:3 -> cross_0 = {a,b,c}, cross_1 = {b,c},
// cross_2 = {c}.
TEST(HorovodLayoutTest, CrossPlacesOnlyWhenNprocsDifferAndMembersOnlyForRankZero) {
  Plan p = PlanRound({{"a", 1, 1, "h", 5}, {"b", 2, 2, "h", 6}, {"c", 3, 3, "h", 7}}, {},
                     {1, 3, 0});
  ASSERT_TRUE(p.formed);
  auto as = MemberAssignments(9, p);
  ASSERT_EQ(as.size(), 3u);
  EXPECT_EQ(as[0].cross_rank, (std::vector<int>{0}));
  EXPECT_EQ(as[0].cross_size, (std::vector<int>{3}));
  EXPECT_EQ(as[1].cross_rank, (std::vector<int>{1, 0}));
  EXPECT_EQ(as[1].cross_size, (std::vector<int>{3, 2}));
  EXPECT_EQ(as[2].cross_rank, (std::vector<int>{2, 1, 0}));
  EXPECT_EQ(as[2].cross_size, (std::vector<int>{3, 2, 1}));
  for (size_t i = 0; i < as.size(); ++i) {
    EXPECT_EQ(as[i].round, 9);
    EXPECT_EQ(as[i].node_rank, static_cast<int>(i));
    EXPECT_EQ(as[i].rank_offset, p.members[i].rank_offset);
    EXPECT_FALSE(as[i].standby);
  }
  using Hosts = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ(as[0].hosts, (Hosts{{"a", 1}, {"b", 2}, {"c", 3}}));
  EXPECT_TRUE(as[1].hosts.empty() && as[2].hosts.empty());
  // The Gloo server's client filter: the members' distinct addresses, rank-0 node only.
  EXPECT_EQ(as[0].host_addrs, (std::vector<std::string>{"h"}));
  EXPECT_TRUE(as[1].host_addrs.empty());
  auto back0 = AssignRecord::Decode(as[0].Encode());
  ASSERT_TRUE(back0.ok()) << back0.status().ToString();
  EXPECT_EQ(back0->host_addrs, as[0].host_addrs);
  EXPECT_FALSE(AssignRecord::Decode(R"({"r":1,"rank":0,"off":0,"hosts":[["a",1]],"ha":[7]})").ok());

  // Same nproc everywhere: cross rank = node rank, cross size = nnodes; nothing per local rank.
  Plan u = PlanRound({{"a", 1, 2, "h", 5}, {"b", 2, 2, "h", 6}}, {}, {1, 3, 0});
  auto us = MemberAssignments(3, u);
  ASSERT_EQ(us.size(), 2u);
  EXPECT_TRUE(us[0].cross_rank.empty() && us[1].cross_rank.empty() && us[1].cross_size.empty());
  EXPECT_EQ(us[0].hosts, (Hosts{{"a", 2}, {"b", 2}}));
  EXPECT_LT(us[1].Encode().size(), 40u);   // a uniform round's records stay as small as before
}

TEST(HorovodLayoutTest, RecordsRoundTripAndRejectDamagedLayouts) {
  AssignRecord a{4, 1, 3, false};
  a.cross_rank = {1, 0};
  a.cross_size = {2, 1};
  a.hosts = {{"n0", 3}, {"n1", 2}};
  auto back = AssignRecord::Decode(a.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->cross_rank, a.cross_rank);
  EXPECT_EQ(back->cross_size, a.cross_size);
  EXPECT_EQ(back->hosts, a.hosts);
  EXPECT_EQ(back->rank_offset, 3);
  for (const char* bad : {R"({"r":1,"rank":0,"off":0,"cr":[0,1],"cs":[2]})",   // lengths differ
                          R"({"r":1,"rank":0,"off":0,"cr":[2],"cs":[2]})",     // rank >= size
                          R"({"r":1,"rank":0,"off":0,"cr":[-1],"cs":[2]})",
                          R"({"r":1,"rank":0,"off":0,"cr":"0","cs":[2]})",
                          R"({"r":1,"rank":0,"off":0,"hosts":[["a"]]})",
                          R"({"r":1,"rank":0,"off":0,"hosts":[["a",0]]})",
                          R"({"r":1,"rank":0,"off":0,"hosts":[[1,2]]})"}) {
    EXPECT_FALSE(AssignRecord::Decode(bad).ok()) << bad;
  }

  AckRecord ack{7, AckState::kAck, 29500, 0};
  ack.horovod_port = 29501;
  auto ack_back = AckRecord::Decode(ack.Encode());
  ASSERT_TRUE(ack_back.ok());
  EXPECT_EQ(ack_back->port, 29500);
  EXPECT_EQ(ack_back->horovod_port, 29501);
  EXPECT_FALSE(AckRecord::Decode(R"({"r":1,"st":"ack","hp":70000})").ok());
  EXPECT_FALSE(ack_back->agent_store);
  ack.agent_store = true;
  ack_back = AckRecord::Decode(ack.Encode());
  ASSERT_TRUE(ack_back.ok());
  EXPECT_TRUE(ack_back->agent_store);
  EXPECT_FALSE(AckRecord::Decode(R"({"r":1,"st":"ack","as":1})").ok());

  RoundRecord r = ActiveRound7();
  r.horovod_port = 29501;
  auto round_back = RoundRecord::Decode(r.Encode());
  ASSERT_TRUE(round_back.ok());
  EXPECT_EQ(round_back->horovod_port, 29501);
  EXPECT_FALSE(round_back->agent_store);
  r.agent_store = true;
  round_back = RoundRecord::Decode(r.Encode());
  ASSERT_TRUE(round_back.ok());
  EXPECT_TRUE(round_back->agent_store);
  EXPECT_LT(r.Encode().size(), 200u);   // every node watches it
}

}  // namespace
}  // namespace efdl::rdzv
