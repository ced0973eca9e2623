// The straggler rules (issue #32, part 3) with fake data and a fake clock.
#include "health/straggler_rules.h"

#include <gtest/gtest.h>

namespace efdl::health {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

StragglerClock::time_point At(double s) {
  return StragglerClock::time_point{} + seconds(1000) +
         milliseconds(static_cast<int64_t>(s * 1000));
}

StragglerPolicy Policy(double factor = 2.0, int window_s = 30) {
  StragglerPolicy p;
  p.factor = factor;
  p.window = seconds(window_s);
  return p;
}

NodeCompute Node(const std::string& id, int64_t round, int64_t seq,
                 std::map<int, double> compute) {
  return {id, round, seq, std::move(compute)};
}

TEST(StragglerRulesTest, ThePeriodIsAThirdOfTheWindowWithAFloorAndGrowsWithTheJob) {
  EXPECT_EQ(PublishPeriod(Policy(2, 30), 3), seconds(10));
  EXPECT_EQ(PublishPeriod(Policy(2, 3), 3), kMinPeriod);
  // 10,000 nodes: at most 100 summaries per second, so one per node every 100 s.
  EXPECT_EQ(PublishPeriod(Policy(2, 30), 10000), seconds(100));
  EXPECT_EQ(PublishPeriod(Policy(2, 30), 1000), seconds(10));
  // The scale rule is the job-wide rate the rendezvous' counts keep too (src/common/job_rate.h).
  EXPECT_EQ(JobRatePeriod(10000), seconds(100));
  EXPECT_EQ(PublishPeriod(Policy(2, 30), 25000), JobRatePeriod(25000));
}

TEST(StragglerRulesTest, AWindowSummarisesEachRankAsTheMedianOfItsSampleMeans) {
  ComputeWindow w;
  // Baselines first: nothing to summarise yet.
  w.Add(0, At(0), 0, 0);
  w.Add(1, At(0), 5'000'000'000, 100);   // a worker that measured before: totals, not samples
  EXPECT_TRUE(w.Summary(At(0), seconds(10)).empty());
  // Rank 0: 10 steps of 20 ms, then 10 of 20 ms, then one outlier second (a 2 s step).
  w.Add(0, At(1), 200'000'000, 10);
  w.Add(0, At(2), 400'000'000, 20);
  w.Add(0, At(3), 2'400'000'000, 21);
  // Rank 1: 5 steps of 100 ms each second; no new step at 3 s (no sample).
  w.Add(1, At(1), 5'500'000'000, 105);
  w.Add(1, At(2), 6'000'000'000, 110);
  w.Add(1, At(3), 6'000'000'000, 110);
  auto s = w.Summary(At(3), seconds(10));
  ASSERT_EQ(s.size(), 2u);
  EXPECT_NEAR(s[0], 0.02, 1e-9);    // median of 20 ms, 20 ms, 2 s: the outlier does not count
  EXPECT_NEAR(s[1], 0.1, 1e-9);
  // Only samples within the period: at 12.5 s, rank 0's last (3 s) is the only one left.
  s = w.Summary(At(12.5), seconds(10));
  ASSERT_EQ(s.size(), 1u);
  EXPECT_NEAR(s[0], 2.0, 1e-9);
  // A fresh worker (totals went back) sets a new baseline instead of a negative sample.
  w.Add(0, At(13), 10'000'000, 1);
  w.Add(0, At(14), 40'000'000, 2);
  s = w.Summary(At(14), milliseconds(1500));
  EXPECT_NEAR(s[0], 0.03, 1e-9);
  w.Reset();
  EXPECT_TRUE(w.Summary(At(14), seconds(10)).empty());
}

TEST(StragglerRulesTest, ANodeIsSlowAtTheFactorOfTheOtherNodesMedianAndAtLeastTheMinimumExcess) {
  const StragglerPolicy p = Policy(2.0);
  const std::vector<NodeCompute> job = {Node("a", 1, 1, {{0, 0.05}, {1, 0.05}}),
                                        Node("b", 1, 1, {{2, 0.05}, {3, 0.06}}),
                                        Node("c", 1, 1, {{4, 0.05}, {5, 0.11}})};
  Comparison c = Compare(p, job[2], job);
  ASSERT_TRUE(c.judged);
  EXPECT_TRUE(c.slow);
  EXPECT_EQ(c.detail.ranks, std::vector<int>{5});
  EXPECT_DOUBLE_EQ(c.detail.compute_s, 0.11);
  EXPECT_DOUBLE_EQ(c.detail.median_s, 0.05);   // of a's and b's ranks, not c's own
  EXPECT_FALSE(Compare(p, job[1], job).slow);  // 0.06: 1.2x
  EXPECT_FALSE(Compare(p, job[0], job).slow);
  // Just under the factor: not slow.
  EXPECT_FALSE(Compare(p, Node("c", 1, 1, {{4, 0.0999}}), job).slow);
  // Two nodes: each is compared with the other (the job's median of two would hide it).
  const std::vector<NodeCompute> two = {Node("a", 1, 1, {{0, 0.05}}),
                                        Node("b", 1, 1, {{1, 0.2}})};
  EXPECT_TRUE(Compare(p, two[1], two).slow);
  EXPECT_FALSE(Compare(p, two[0], two).slow);
  // Tiny steps: 3x, but only 2 ms more per step: noise, not a straggler.
  const std::vector<NodeCompute> tiny = {Node("a", 1, 1, {{0, 0.001}}),
                                         Node("b", 1, 1, {{1, 0.003}})};
  EXPECT_FALSE(Compare(p, tiny[1], tiny).slow);
  // Alone, or nothing measured, or off: not judged.
  EXPECT_FALSE(Compare(p, two[1], {two[1]}).judged);
  EXPECT_FALSE(Compare(p, Node("b", 1, 1, {}), two).judged);
  EXPECT_FALSE(Compare(Policy(0), two[1], two).judged);
  // Summaries of another round are no reference.
  EXPECT_FALSE(Compare(p, two[1], {Node("a", 0, 1, {{0, 0.05}}), two[1]}).judged);
}

TEST(StragglerRulesTest, ANodeSlowInThreeConsecutiveNewSummariesIsNamedOnce) {
  StragglerJudge judge(Policy(2.0));
  auto job = [](int64_t seq, double c_time, int64_t round = 1) {
    return std::vector<NodeCompute>{Node("a", round, seq, {{0, 0.05}}),
                                    Node("b", round, seq, {{1, 0.05}}),
                                    Node("c", round, seq, {{2, c_time}})};
  };
  EXPECT_TRUE(judge.Judge(1, job(1, 0.2)).stragglers.empty());
  EXPECT_TRUE(judge.Judge(1, job(2, 0.2)).stragglers.empty());
  // The same summaries read again (the judge read before the nodes published): not counted.
  EXPECT_TRUE(judge.Judge(1, job(2, 0.2)).stragglers.empty());
  StragglerJudge::Verdict v = judge.Judge(1, job(3, 0.2));
  ASSERT_EQ(v.stragglers.size(), 1u);
  ASSERT_EQ(v.named.size(), 1u);
  EXPECT_EQ(v.named[0].node, "c");
  EXPECT_EQ(v.named[0].ranks, std::vector<int>{2});
  EXPECT_EQ(v.named[0].windows, 3);
  EXPECT_NEAR(v.named[0].ratio(), 4.0, 1e-9);
  // Still slow: still a straggler, not named again.
  v = judge.Judge(1, job(4, 0.2));
  EXPECT_EQ(v.stragglers.size(), 1u);
  EXPECT_TRUE(v.named.empty());
  EXPECT_EQ(v.stragglers[0].windows, 4);
  // One summary at normal speed clears it.
  v = judge.Judge(1, job(5, 0.05));
  EXPECT_TRUE(v.stragglers.empty());
  EXPECT_EQ(v.cleared, std::vector<std::string>{"c"});
}

TEST(StragglerRulesTest, AnInterruptedStreakANewRoundOrANodeThatLeftStartsAgain) {
  StragglerJudge judge(Policy(2.0));
  auto job = [](int64_t seq, double c_time, int64_t round) {
    return std::vector<NodeCompute>{Node("a", round, seq, {{0, 0.05}}),
                                    Node("b", round, seq, {{1, 0.05}}),
                                    Node("c", round, seq, {{2, c_time}})};
  };
  judge.Judge(1, job(1, 0.2, 1));
  judge.Judge(1, job(2, 0.2, 1));
  judge.Judge(1, job(3, 0.05, 1));   // not slow: the streak ends
  judge.Judge(1, job(4, 0.2, 1));
  EXPECT_TRUE(judge.Judge(1, job(5, 0.2, 1)).stragglers.empty());
  EXPECT_EQ(judge.Judge(1, job(6, 0.2, 1)).named.size(), 1u);
  // A new round: summaries of the old one are ignored and the straggler is cleared.
  StragglerJudge::Verdict v = judge.Judge(2, job(7, 0.2, 1));
  EXPECT_TRUE(v.stragglers.empty());
  EXPECT_EQ(v.cleared, std::vector<std::string>{"c"});
  judge.Judge(2, job(8, 0.2, 2));
  judge.Judge(2, job(9, 0.2, 2));
  EXPECT_EQ(judge.Judge(2, job(10, 0.2, 2)).named.size(), 1u);
  // The straggler's summary is gone (it left): cleared.
  v = judge.Judge(2, {Node("a", 2, 11, {{0, 0.05}}), Node("b", 2, 11, {{1, 0.05}})});
  EXPECT_TRUE(v.stragglers.empty());
  EXPECT_EQ(v.cleared, std::vector<std::string>{"c"});
}

TEST(StragglerRulesTest, EqualNodesWithNoiseAreNeverNamed) {
  // Three equal nodes on a loaded machine: each summary's compute times wander by up to +-30%
  // around 50 ms (a fixed pseudo-random sequence): at most 1.86x apart, so factor 2 never fires.
  StragglerJudge judge(Policy(2.0));
  uint64_t x = 12345;
  auto noise = [&x]() {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return 0.7 + 0.6 * static_cast<double>(x >> 11) / static_cast<double>(1ULL << 53);
  };
  for (int64_t seq = 1; seq <= 1000; ++seq) {
    const auto v = judge.Judge(1, {Node("a", 1, seq, {{0, 0.05 * noise()}}),
                                   Node("b", 1, seq, {{1, 0.05 * noise()}}),
                                   Node("c", 1, seq, {{2, 0.05 * noise()}})});
    ASSERT_TRUE(v.stragglers.empty()) << seq;
  }
}

}  // namespace
}  // namespace efdl::health
