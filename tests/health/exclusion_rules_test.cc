// The exclusion rule of nodes that keep failing (issue #32, part 4), with a fake clock.
#include "health/exclusion_rules.h"

#include <gtest/gtest.h>

namespace efdl::health {
namespace {

using std::chrono::seconds;
using Action = FailureVerdict::Action;

// A fake clock: time points are an arbitrary epoch plus the seconds given.
FailureClock::time_point At(int s) { return FailureClock::time_point{} + seconds(1000 + s); }

ExclusionPolicy Policy(int after, int window_s, int cooldown_s, int max_restarts) {
  ExclusionPolicy p;
  p.after = after;
  p.window = seconds(window_s);
  p.cooldown = seconds(cooldown_s);
  p.max_restarts = max_restarts;
  return p;
}

TEST(ExclusionRulesTest, TheKthOwnFailureWithinTheWindowExcludesForTheCooldown) {
  OwnFailures f(Policy(3, 600, 300, 3));
  EXPECT_EQ(f.Count(At(0), true).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(100), true).action, Action::kRestart);
  const FailureVerdict v = f.Count(At(200), true);
  EXPECT_EQ(v.action, Action::kExclude);
  EXPECT_EQ(v.in_window, 3);
  EXPECT_EQ(v.total, 3);
  EXPECT_EQ(v.exclusion, 1);
  EXPECT_EQ(v.cooldown, seconds(300));
  EXPECT_EQ(v.until, At(500));
  // A clean slate after the exclusion: the next failure starts a new count.
  EXPECT_EQ(f.InWindow(At(500)), 0);
  EXPECT_EQ(f.Count(At(510), true).action, Action::kRestart);
  EXPECT_EQ(f.total(), 4);
}

TEST(ExclusionRulesTest, FailuresOlderThanTheWindowDoNotCount) {
  OwnFailures f(Policy(3, 60, 30, 100));
  EXPECT_EQ(f.Count(At(0), true).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(30), true).action, Action::kRestart);
  // The first failure is exactly one window old: out of it.
  const FailureVerdict v = f.Count(At(60), true);
  EXPECT_EQ(v.action, Action::kRestart);
  EXPECT_EQ(v.in_window, 2);
  EXPECT_EQ(v.total, 3);
  EXPECT_EQ(f.InWindow(At(89)), 2);
  EXPECT_EQ(f.InWindow(At(90)), 1);
  EXPECT_EQ(f.Count(At(89), true).action, Action::kExclude);
}

TEST(ExclusionRulesTest, TheCooldownDoublesWithEachExclusionUpToACap) {
  const ExclusionPolicy p = Policy(1, 600, 10, 3);
  EXPECT_EQ(CooldownFor(p, 1), seconds(10));
  EXPECT_EQ(CooldownFor(p, 2), seconds(20));
  EXPECT_EQ(CooldownFor(p, 3), seconds(40));
  EXPECT_EQ(CooldownFor(p, 4), seconds(10 * kMaxCooldownFactor));
  EXPECT_EQ(CooldownFor(p, 40), seconds(10 * kMaxCooldownFactor));
  OwnFailures f(p);
  EXPECT_EQ(f.Count(At(0), true).cooldown, seconds(10));
  const FailureVerdict second = f.Count(At(20), true);
  EXPECT_EQ(second.exclusion, 2);
  EXPECT_EQ(second.until, At(40));
  EXPECT_EQ(f.exclusions(), 2);
}

TEST(ExclusionRulesTest, ANodeTheJobCannotDoWithoutIsNotExcludedAndGivesUpPastMaxRestarts) {
  OwnFailures f(Policy(2, 600, 300, 2));
  EXPECT_EQ(f.Count(At(0), false).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(1), false).action, Action::kRestart);   // 2 in the window, not excluded
  const FailureVerdict v = f.Count(At(2), false);
  EXPECT_EQ(v.action, Action::kGiveUp);
  EXPECT_EQ(v.total, 3);
  EXPECT_EQ(f.exclusions(), 0);
}

TEST(ExclusionRulesTest, WhileExclusionIsPossibleMaxRestartsNoLongerEndsTheNode) {
  OwnFailures f(Policy(3, 600, 300, 0));
  EXPECT_EQ(f.Count(At(0), true).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(1), true).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(2), true).action, Action::kExclude);
  // Later, the job cannot go on without it: today's rule applies to the life-long count.
  EXPECT_EQ(f.Count(At(400), false).action, Action::kGiveUp);
}

TEST(ExclusionRulesTest, ExcludeAfterZeroKeepsTodaysRule) {
  OwnFailures f(Policy(0, 600, 300, 1));
  EXPECT_EQ(f.Count(At(0), true).action, Action::kRestart);
  EXPECT_EQ(f.Count(At(1), true).action, Action::kGiveUp);
  EXPECT_EQ(f.exclusions(), 0);
}

}  // namespace
}  // namespace efdl::health
