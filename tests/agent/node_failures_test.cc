// NodeFailures alone (issue #31 step 1, issue #32): the collateral streak, whether the job can
// go on without the node, the counted failures and the end of an exclusion, on a fake clock.
#include "agent/node_failures.h"

#include <chrono>

#include <gtest/gtest.h>

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Action = health::FailureVerdict::Action;

health::ExclusionPolicy Policy(int max_restarts) {
  health::ExclusionPolicy p;
  p.after = 3;
  p.window = 600s;
  p.cooldown = 300s;
  p.max_restarts = max_restarts;
  return p;
}

rdzv::Assignment Round(int nnodes, bool standby = false) {
  rdzv::Assignment a;
  a.nnodes = nnodes;
  a.standby = standby;
  return a;
}

TEST(NodeFailuresTest, ACollateralStreakCountsOnlyOnceItIsTooLong) {
  NodeFailures f(Policy(/*max_restarts=*/3), 1);
  f.RoundFormed(3);
  Clock::time_point t = Clock::now();
  // Rounds that last a few seconds each: the first max(6, 2 x 3) collateral failures are not
  // counted, the next one is.
  for (int i = 1; i <= NodeFailures::kCollateralStreak; ++i) {
    EXPECT_FALSE(f.CollateralCounts(t + 5s, t)) << i;
    EXPECT_EQ(f.streak(), i);
    t += 10s;
  }
  EXPECT_TRUE(f.CollateralCounts(t + 5s, t));
  // A round that lasted kStreakReset starts a new streak.
  t += 100s;
  EXPECT_FALSE(f.CollateralCounts(t + NodeFailures::kStreakReset, t));
  EXPECT_EQ(f.streak(), 1);
}

TEST(NodeFailuresTest, TheStreakIsAtLeastTwiceMaxRestartsAndEndsWithTheNodeCountOrAnOwnFailure) {
  NodeFailures f(Policy(/*max_restarts=*/5), 1);
  const Clock::time_point t = Clock::now();
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(f.CollateralCounts(t + 1s, t)) << i;
  EXPECT_TRUE(f.CollateralCounts(t + 1s, t)) << "the 11th of a streak bounded by 2 x 5";
  f.RoundFormed(2);
  f.RoundFormed(2);   // the same count: the streak goes on
  EXPECT_EQ(f.streak(), 0);
  EXPECT_FALSE(f.CollateralCounts(t + 1s, t));
  f.RoundFormed(2);
  EXPECT_EQ(f.streak(), 1);
  f.RoundFormed(3);   // a node joined
  EXPECT_EQ(f.streak(), 0);
  EXPECT_FALSE(f.CollateralCounts(t + 1s, t));
  f.EndStreak();      // an own failure
  EXPECT_EQ(f.streak(), 0);
}

TEST(NodeFailuresTest, TheJobGoesOnWithoutTheNodeWhenMinOthersRemain) {
  NodeFailures f(Policy(3), /*min_nodes=*/2);
  EXPECT_TRUE(f.CanExclude(Round(3)));
  EXPECT_FALSE(f.CanExclude(Round(2)));
  EXPECT_TRUE(f.CanExclude(Round(2, /*standby=*/true)));   // a standby's round holds others
  NodeFailures alone(Policy(3), /*min_nodes=*/1);
  EXPECT_FALSE(alone.CanExclude(Round(1)));
  EXPECT_TRUE(alone.CanExclude(Round(2)));
}

TEST(NodeFailuresTest, CountedFailuresExcludeThenTheNodeIsOutUntilTheCooldownEnds) {
  NodeFailures f(Policy(3), 1);
  const Clock::time_point t = Clock::now();
  EXPECT_EQ(f.Count(t, true).action, Action::kRestart);
  EXPECT_EQ(f.Count(t + 1s, true).action, Action::kRestart);
  // Asked ahead: the third would exclude; asking counts nothing.
  EXPECT_EQ(f.CountAhead(t + 2s, true).action, Action::kExclude);
  EXPECT_EQ(f.CountAhead(t + 2s, false).action, Action::kRestart);
  EXPECT_EQ(f.restarts(), 2);
  const health::FailureVerdict v = f.Count(t + 2s, true);
  ASSERT_EQ(v.action, Action::kExclude);
  EXPECT_EQ(f.restarts(), 3);
  EXPECT_EQ(f.exclusions(), 1);
  EXPECT_EQ(f.CheckOut(t), NodeFailures::Out::kNo);
  EXPECT_FALSE(f.out());
  f.OutUntil(v.until);
  EXPECT_TRUE(f.out());
  EXPECT_EQ(f.CheckOut(v.until - 1s), NodeFailures::Out::kStill);
  EXPECT_EQ(f.CheckOut(v.until), NodeFailures::Out::kBack);
  EXPECT_FALSE(f.out());
  EXPECT_EQ(f.CheckOut(v.until + 1s), NodeFailures::Out::kNo) << "back is said once";
}

TEST(NodeFailuresTest, AFailureWaitsToBeCountedAndAConnectErrorIsExplainedOnce) {
  NodeFailures f(Policy(3), 1);
  EXPECT_FALSE(f.pending().has_value());
  f.pending() = PendingFailure{4, 2, "rank 1 exited with status 1", std::nullopt, {}, {}};
  ASSERT_TRUE(f.pending().has_value());
  EXPECT_EQ(f.pending()->round, 4);
  EXPECT_EQ(f.restarts(), 0) << "recorded, not counted";
  EXPECT_TRUE(f.FirstConnectErrorExplanation());
  EXPECT_FALSE(f.FirstConnectErrorExplanation()) << "once per agent";
}

}  // namespace
}  // namespace efdl::agent
