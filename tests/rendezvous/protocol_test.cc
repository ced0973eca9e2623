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

TEST(RecordsTest, RoundTripAndRejectGarbage) {
  RoundRecord r;
  r.round = 7;
  r.phase = Phase::kActive;
  r.coordinator = "n1";
  r.deputies = {"n2", "n3"};
  r.world_size = 12;
  r.nnodes = 3;
  r.master_addr = "10.0.0.1";
  r.master_port = 29500;
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
  EXPECT_NE(s.message().find("'/'"), std::string::npos);
  EXPECT_FALSE(ValidateId("node id", "").ok());
  EXPECT_FALSE(ValidateId("node id", std::string(200, 'x')).ok());
}

}  // namespace
}  // namespace efdl::rdzv
