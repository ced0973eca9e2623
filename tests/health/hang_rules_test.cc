#include "health/hang_rules.h"

#include <gtest/gtest.h>

namespace efdl::health {
namespace {

constexpr int64_t kSec = 1000000000LL;

TEST(HangRulesTest, AutoTimeoutIsTenTimesTheSlowestIntervalWithAFloor) {
  const HangConfig autocfg{-1};
  EXPECT_DOUBLE_EQ(RunningTimeout(autocfg, 0), kAutoFloorSeconds);
  EXPECT_DOUBLE_EQ(RunningTimeout(autocfg, 2.0), kAutoFloorSeconds);
  EXPECT_DOUBLE_EQ(RunningTimeout(autocfg, 60.0), 600.0);
  EXPECT_DOUBLE_EQ(FirstProgressGrace(autocfg, 0), kAutoFirstFloorSeconds);
  EXPECT_DOUBLE_EQ(FirstProgressGrace(autocfg, 60.0), 1800.0);
  const HangConfig ten{10};
  EXPECT_DOUBLE_EQ(RunningTimeout(ten, 60.0), 10.0);
  EXPECT_DOUBLE_EQ(FirstProgressGrace(ten, 0), kExplicitFirstFloorSeconds);
}

TEST(HangRulesTest, NothingIsJudgedBeforeTheProgramReportedOrWhenOff) {
  RankTrack r;
  r.progressed = true;
  r.since_ns = 0;
  EXPECT_FALSE(Judge({10}, r, /*program_reports=*/false, 0, 3600 * kSec).hung);
  EXPECT_FALSE(Judge({0}, r, true, 0, 3600 * kSec).hung);
}

TEST(HangRulesTest, ARankSilentForItsTimeoutIsHung) {
  RankTrack r;
  r.progressed = true;
  r.since_ns = 100 * kSec;
  EXPECT_FALSE(Judge({10}, r, true, 0.1, 109 * kSec).hung);
  const Judgement j = Judge({10}, r, true, 0.1, 110 * kSec);
  EXPECT_TRUE(j.hung);
  EXPECT_DOUBLE_EQ(j.silent_s, 10.0);
  EXPECT_DOUBLE_EQ(j.limit_s, 10.0);
}

TEST(HangRulesTest, ATenTimesSlowerFirstStepIsNotAHangUnderAuto) {
  // Steps of 2 s; the round's first step (compiling, restoring) takes 20 s: the first-progress
  // grace (600 s) applies, not the running timeout.
  RankTrack r;
  r.progressed = false;
  r.since_ns = 0;
  EXPECT_FALSE(Judge({-1}, r, true, 2.0, 20 * kSec).hung);
  EXPECT_FALSE(Judge({-1}, r, true, 2.0, 599 * kSec).hung);
  EXPECT_TRUE(Judge({-1}, r, true, 2.0, 600 * kSec).hung);
}

TEST(HangRulesTest, AnAnnouncedPauseDefersTheTimeoutToItsEnd) {
  RankTrack r;
  r.progressed = true;
  r.since_ns = 0;
  r.pause_until_ns = 30 * kSec;   // a 3x-longer evaluation, announced
  EXPECT_FALSE(Judge({10}, r, true, 1.0, 29 * kSec).hung);
  EXPECT_FALSE(Judge({10}, r, true, 1.0, 39 * kSec).hung);
  EXPECT_TRUE(Judge({10}, r, true, 1.0, 40 * kSec).hung);
}

TEST(HangRulesTest, StacksInACollectiveAreToldFromTheOthers) {
  EXPECT_TRUE(StackInCollective(
      "Thread 0x1 (most recent call first):\n"
      "  File \"/usr/lib/python3/dist-packages/torch/autograd/__init__.py\", line 197 in "
      "backward\n  File \"train.py\", line 40 in main\n"));
  EXPECT_TRUE(StackInCollective(
      "  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line "
      "1536 in all_reduce\n"));
  EXPECT_FALSE(StackInCollective(
      "Current thread 0x1 (most recent call first):\n  File \"train.py\", line 51 in main\n"));
  EXPECT_FALSE(StackInCollective(""));
}

TEST(HangRulesTest, SlowestOfTheWindow) {
  EXPECT_DOUBLE_EQ(Slowest({}), 0);
  EXPECT_DOUBLE_EQ(Slowest({0.1, 0.5, 0.2}), 0.5);
}

}  // namespace
}  // namespace efdl::health
