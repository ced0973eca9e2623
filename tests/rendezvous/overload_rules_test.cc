// The overload rules of node_rules.h (issue #37): a node's join back-off when etcd is slow and
// the bound on takeovers per period. Pure functions: no etcd, no clock.
#include <gtest/gtest.h>

#include "rendezvous/coordination.h"
#include "rendezvous/node_rules.h"

namespace efdl::rdzv {
namespace {

using std::chrono::milliseconds;

TEST(JoinBackoffTest, AFastEtcdDelaysNoFirstAttempt) {
  // A small or healthy job: registrations answered in a few ms, so a fenced node rejoins at once.
  for (double r : {0.0, 0.5, 0.999}) {
    EXPECT_EQ(JoinBackoff(0, milliseconds(3), r), milliseconds(0));
    EXPECT_EQ(JoinBackoff(0, kSlowEtcd - milliseconds(1), r), milliseconds(0));
  }
}

TEST(JoinBackoffTest, ASlowEtcdSpreadsTheCrowdOverHalfTheBackoffAndDoublesPerAttempt) {
  const milliseconds slow(2000);
  EXPECT_EQ(JoinBackoff(0, slow, 0.0), milliseconds(1000));
  EXPECT_EQ(JoinBackoff(0, slow, 0.999), milliseconds(1999));
  EXPECT_EQ(JoinBackoff(1, slow, 0.0), milliseconds(2000));   // 4 s doubled once, half fixed
  EXPECT_EQ(JoinBackoff(2, slow, 0.0), milliseconds(4000));
  // Capped, and a crowd of 1000 nodes' random draws lands over the whole second half.
  EXPECT_LE(JoinBackoff(30, slow, 0.999), kMaxJoinBackoff);
  EXPECT_GE(JoinBackoff(30, slow, 0.0), kMaxJoinBackoff / 2);
  // A retry after a quick failure still waits (the first retry of a failed join).
  EXPECT_GE(JoinBackoff(1, milliseconds(1), 0.0), kSlowEtcd);
}

TEST(FencedRoundTest, ARoundStillGatheringOrProposedIsNotFencedADecidedOneIs) {
  RoundRecord r;
  r.round = 4;
  NodePart waiting{"n", 0, 0, false, 0};
  NodePart acked{"n", 4, 0, false, 0};
  NodePart running{"n", 3, 3, false, 0};
  for (Phase p : {Phase::kGathering, Phase::kProposed}) {
    r.phase = p;
    EXPECT_EQ(FencedRound(r, waiting), 0);   // it registers again and acks round 4
    EXPECT_EQ(FencedRound(r, acked), 0);
    EXPECT_EQ(FencedRound(r, running), 3);   // never round 3 again, whose place it held
    if (p == Phase::kProposed) {   // the new registration acks the proposal (reset acked_round)
      EXPECT_TRUE(ShouldAck(r, {"n", 0, 0, false, FencedRound(r, acked)}));
    }
  }
  r.phase = Phase::kActive;
  EXPECT_EQ(FencedRound(r, waiting), 4);     // its assignment of round 4 may be in etcd
  EXPECT_EQ(FencedRound(r, running), 4);
}

TEST(TtlAfterExpiriesTest, DoublesPerExpiryUpToEightTimesAndACap) {
  EXPECT_EQ(TtlAfterExpiries(milliseconds(10000), 0), milliseconds(10000));
  EXPECT_EQ(TtlAfterExpiries(milliseconds(10000), 1), milliseconds(20000));
  EXPECT_EQ(TtlAfterExpiries(milliseconds(3000), 3), milliseconds(24000));
  EXPECT_EQ(TtlAfterExpiries(milliseconds(3000), 30), milliseconds(24000));
  EXPECT_EQ(TtlAfterExpiries(milliseconds(30000), 3), kMaxAdaptedTtl);
  EXPECT_EQ(TtlAfterExpiries(milliseconds(200000), 2), milliseconds(200000));  // never lower
}

TEST(TakeoverBackoffTest, BoundsTakeoversPerPeriodAndLeavesAQuietJobAlone) {
  EXPECT_EQ(TakeoverBackoff(0), milliseconds(0));
  EXPECT_EQ(TakeoverBackoff(kMaxTakeoversPerPeriod - 1), milliseconds(0));
  const milliseconds step = kTakeoverPeriod / kMaxTakeoversPerPeriod;
  EXPECT_EQ(TakeoverBackoff(kMaxTakeoversPerPeriod), step);
  EXPECT_EQ(TakeoverBackoff(kMaxTakeoversPerPeriod + 2), 3 * step);
}

TEST(TakeoverBackoffTest, OnlyATakeoverRecordCountsAsATakeover) {
  RoundRecord r;
  r.round = 4;
  r.phase = Phase::kActive;
  r.coordinator = "a";
  r.deputies = {"b", "c"};
  EXPECT_TRUE(IsTakeOver(r, TakeOverRecord(r, "b")));
  EXPECT_FALSE(IsTakeOver(r, HandOverRecord(r, "a", "b")));          // a graceful hand-over
  EXPECT_FALSE(IsTakeOver(r, FailureProposal(r, "c", "worker died")));  // a failure proposal
  RoundRecord same = r;
  same.round = 5;
  EXPECT_FALSE(IsTakeOver(r, same));
}

// Issue #37: the follow watch kept open across rounds counts a deletion exactly as a watch
// started where the node now follows from would deliver it.
TEST(FollowWatchTest, AKeptWatchServesALaterFollowAndCountsOnlyDeletionsAfterIt) {
  const FollowWatch kept{"c", 10, 0};
  EXPECT_TRUE(FollowWatchCovers(kept, "c", 10));
  EXPECT_TRUE(FollowWatchCovers(kept, "c", 25));     // the next proposal, same coordinator
  EXPECT_FALSE(FollowWatchCovers(kept, "c", 9));     // it misses revision 10
  EXPECT_FALSE(FollowWatchCovers(kept, "d", 25));    // another coordinator's key
  EXPECT_FALSE(FollowWatchCovers(FollowWatch{}, "", 25));
  const FollowWatch deleted{"c", 10, 20};            // delivered c's deletion at revision 20
  EXPECT_TRUE(FollowedIsGone(deleted, "c", 19));
  EXPECT_FALSE(FollowedIsGone(deleted, "c", 20));    // before the round record it follows from
  EXPECT_FALSE(FollowedIsGone(deleted, "c", 25));
  EXPECT_FALSE(FollowedIsGone(deleted, "", 0));      // following nobody
  EXPECT_FALSE(FollowedIsGone(deleted, "d", 0));
  EXPECT_FALSE(FollowedIsGone(kept, "c", 0));
}

}  // namespace
}  // namespace efdl::rdzv
