// The goodput ledger's arithmetic (rendezvous/ledger.h) on made-up parts of three nodes, and its
// records through the in-memory etcd.
#include "rendezvous/ledger.h"

#include <gtest/gtest.h>

#include <numeric>

#include "support/memory_etcd.h"

namespace efdl::rdzv {
namespace {

LedgerPart Part(const std::string& node, int64_t round, double start, double progress,
                int64_t step, int world, int nodes) {
  LedgerPart p;
  p.step_s = round == 1 ? 0 : 0.5;   // what a node saw of the previous round's steps
  p.node = node;
  p.round = round;
  p.start = start;
  p.progress = progress;
  p.step = step;
  p.world = world;
  p.nnodes = nodes;
  return p;
}

double Sum(const LedgerTotals& t) {
  double s = 0;
  for (const auto& [_, v] : t.seconds) s += v;
  return s;
}

// Round 1 (a, b, c) trains from 102 to 200, when c crashes; a sees it at 200.5 (its last step
// 40 at 200.4), b at 201; round 2 (a, b) starts at 203 and resumes after step 36 at 204.
// Round 3 adds d (a join, graceful: nothing trained again); the job completes at 300.
std::vector<LedgerPart> Parts() {
  std::vector<LedgerPart> v;
  for (const char* n : {"a", "b", "c"}) v.push_back(Part(n, 1, 100, 102, 1, 3, 3));
  v[0].why = v[1].why = v[2].why = "job started";
  for (const char* n : {"a", "b"}) {
    LedgerPart p = Part(n, 2, n[0] == 'a' ? 202.5 : 203, 204, 37, 2, 2);
    p.prev_world = 3;
    p.prev_nnodes = 3;
    p.sign = n[0] == 'a' ? 200.5 : 201;
    p.prev_step = n[0] == 'a' ? 40 : 39;
    p.prev_at = 200.4;
    p.why = "node c is gone";
    v.push_back(p);
  }
  for (const char* n : {"a", "b", "d"}) {
    LedgerPart p = Part(n, 3, 250, 251, 101, 3, 3);
    if (n[0] != 'd') {
      p.prev_world = 2;
      p.prev_nnodes = 2;
      p.sign = 249;
      p.prev_step = 100;
      p.graceful = true;
    }
    p.why = "node d joined";
    v.push_back(p);
  }
  return v;
}

TEST(LedgerTest, EventsCarryTheirPhasesAndTheStepsTrainedAgain) {
  std::vector<LedgerEnd> ends = {{"a", 3, 300, "complete"}, {"b", 3, 300.2, "complete"}};
  const LedgerReport r = Summarize(Parts(), ends, /*now=*/999);
  ASSERT_EQ(r.events.size(), 2u);
  const LedgerEvent& crash = r.events[0];
  EXPECT_EQ(crash.round, 2);
  EXPECT_EQ(crash.kind, "crash");
  EXPECT_EQ(crash.world_before, 3);
  EXPECT_EQ(crash.world_after, 2);
  EXPECT_DOUBLE_EQ(crash.at, 200.5);            // the earliest sign
  EXPECT_DOUBLE_EQ(crash.rendezvous_s, 2.5);    // to the latest start, 203
  EXPECT_DOUBLE_EQ(crash.restore_s, 1.0);       // to every rank's progress, 204
  EXPECT_DOUBLE_EQ(crash.pause_s, crash.detection_s + crash.rendezvous_s + crash.restore_s);
  EXPECT_EQ(crash.steps_lost, 4);               // steps 37..40 trained again
  const LedgerEvent& join = r.events[1];
  EXPECT_EQ(join.kind, "join");
  EXPECT_EQ(join.steps_lost, 0);
  EXPECT_EQ(join.nodes, (std::vector<std::string>{"a", "b", "d"}));
  EXPECT_EQ(crash.left, (std::vector<std::string>{"c"}));   // which node the crash took
  EXPECT_TRUE(crash.joined.empty());
  EXPECT_EQ(join.joined, (std::vector<std::string>{"d"}));
  EXPECT_TRUE(join.left.empty());
  EXPECT_TRUE(r.complete);
}

TEST(LedgerTest, StepsTrainedAgainAreTheUncommittedStepsWhenTheProgramCountsThem) {
  // A program whose step restarts at each epoch: the step difference means nothing across an
  // epoch's end, the count of reports after the newest snapshot does.
  std::vector<LedgerPart> v = Parts();
  for (auto& p : v) {
    if (p.round == 2) p.uncommitted = p.node == "a" ? 3 : 2;
    if (p.round == 3) {
      p.uncommitted = 0;     // a graceful change: the final snapshot
      p.step = 1;            // the new epoch's first step
    }
  }
  const LedgerReport r = Summarize(v, {}, 999);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0].steps_lost, 3);
  EXPECT_EQ(r.events[1].steps_lost, 0);
}

TEST(LedgerTest, TheRestoreAndTheFirstStepAreTwoPhasesWhenEveryNodeSaidWhereTheRestoreEnded) {
  // Round 2: a's ranks restored at 203.4, b's at 203.6 (progress at 204, started 203).
  std::vector<LedgerPart> v = Parts();
  for (auto& p : v) {
    if (p.round == 2) p.restored = p.node == "a" ? 203.4 : 203.6;
    if (p.round == 3 && p.node == "a") p.restored = 250.5;   // b and d did not say
  }
  const LedgerReport r = Summarize(v, {}, 999);
  ASSERT_EQ(r.events.size(), 2u);
  const LedgerEvent& crash = r.events[0];
  EXPECT_NEAR(crash.restore_s, 0.6, 1e-9);      // 203 -> the last node's restore, 203.6
  EXPECT_NEAR(crash.first_step_s, 0.4, 1e-9);   // -> every rank's progress, 204
  EXPECT_NEAR(crash.pause_s, crash.detection_s + crash.rendezvous_s + crash.restore_s +
                                 crash.first_step_s, 1e-9);
  // A round where a node did not say: the whole stretch is the restore, as before.
  EXPECT_DOUBLE_EQ(r.events[1].restore_s, 1.0);
  EXPECT_DOUBLE_EQ(r.events[1].first_step_s, 0);
  EXPECT_NE(r.ToText(5).find("restore 0.60, first step 0.40"), std::string::npos) << r.ToText(5);
}

TEST(LedgerTest, SamplesTrainedAgainAreTheStepsTimesTheSamplesPerStepOfThePreviousWorld) {
  std::vector<LedgerPart> v = Parts();
  for (auto& p : v) {
    if (p.round == 2) p.step_samples = p.node == "a" ? 32 : 32;   // per rank per step
  }
  const LedgerReport r = Summarize(v, {}, 999);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0].samples_lost, 4 * 32 * 3);   // 4 steps x 32 x world 3 before
  EXPECT_DOUBLE_EQ(r.events[0].step_samples, 32);
  EXPECT_EQ(r.events[1].samples_lost, -1);           // nobody counted: unknown
  EXPECT_NE(r.ToText(5).find("4 step(s) (384 samples) trained again"), std::string::npos)
      << r.ToText(5);
  EXPECT_NE(r.ToJson().find("\"samples_lost\": 384"), std::string::npos);
  EXPECT_NE(r.ToJson().find("\"samples_lost\": null"), std::string::npos);
}

TEST(LedgerTest, ARoundThatBrokeBeforeAnyProgressTrainedNothingItsTimeIsRestore) {
  // Round 2 (a, b) starts at 203 and breaks before any rank reported progress (the parts are
  // written at that end); round 3 begins with its sign at 249.
  std::vector<LedgerPart> v = Parts();
  for (auto& p : v) {
    if (p.round == 2) {
      p.progress = 0;
      p.step = -1;
      p.ended_before_progress = true;
    }
  }
  std::vector<LedgerEnd> ends = {{"a", 3, 300, "complete"}};
  const LedgerReport r = Summarize(v, ends, 999);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_DOUBLE_EQ(r.events[0].restore_s, 249 - 203.0);   // all of round 2
  EXPECT_DOUBLE_EQ(r.events[0].first_step_s, 0);
  // Training: round 1 (102 -> 200.5, less what round 2 trains again: none, it never stepped)
  // and round 3 (251 -> 300); round 2's 46 s are restore, not training.
  EXPECT_NEAR(r.totals.seconds.at("training"), (200.5 - 102) + (300 - 251), 2.0);
  EXPECT_NEAR(r.totals.seconds.at("restore"), 46 + 1, 1e-9);
  EXPECT_NEAR(Sum(r.totals), r.totals.wall_s, 1e-6);
  auto decoded = LedgerPart::Decode(v[3].Encode());
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(decoded->ended_before_progress);
}

TEST(LedgerTest, ARoundThatWaitedForNodesBelowMinCountsTheWaitAsWaiting) {
  // MIN 3: c crashes at 200 (a and b stay), d joins at 230, round 2 starts at 232.
  std::vector<LedgerPart> v;
  for (const char* n : {"a", "b", "c"}) {
    v.push_back(Part(n, 1, 100, 102, 1, 3, 3));
    v.back().min_nodes = 3;
    v.back().joined = 99;
  }
  for (const char* n : {"a", "b", "d"}) {
    LedgerPart p = Part(n, 2, 232, 233, 50, 3, 3);
    p.min_nodes = 3;
    if (n[0] == 'd') {
      p.joined = 230;
    } else {
      p.sign = 200;
      p.prev_world = p.prev_nnodes = 3;
    }
    v.push_back(p);
  }
  const LedgerReport r = Summarize(v, {}, 300);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_DOUBLE_EQ(r.events[0].waiting_s, 30);
  EXPECT_DOUBLE_EQ(r.events[0].rendezvous_s, 2);
  EXPECT_DOUBLE_EQ(r.events[0].pause_s, 33);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("waiting"), 30);
  EXPECT_NEAR(Sum(r.totals), r.totals.wall_s, 1e-9);
}

TEST(LedgerTest, TheCategoriesAddUpToTheWallTime) {
  std::vector<LedgerEnd> ends = {{"a", 3, 300, "complete"}};
  const LedgerReport r = Summarize(Parts(), ends, 999);
  EXPECT_DOUBLE_EQ(r.totals.wall_s, 200);       // 100 .. 300
  EXPECT_NEAR(Sum(r.totals), r.totals.wall_s, 1e-9);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("startup"), 2);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("lost"), 2);            // 4 steps of 0.5 s
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("rendezvous"), 2.5 + 1);   // 200.5-203, 249-250
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("restore"), 1 + 1);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("training"), 200 - 2 - 2 - 3.5 - 2);
  EXPECT_NEAR(r.totals.goodput(), 190.5 / 200, 1e-12);
}

TEST(LedgerTest, AHangsSilenceIsHungTimeAndAResumeAfterASuspendIsSuspendedTime) {
  std::vector<LedgerPart> v = {Part("a", 1, 0, 1, 1, 1, 1)};
  LedgerPart hang = Part("a", 2, 30, 31, 11, 1, 1);
  hang.sign = 20;            // the last progress
  hang.detection_s = 8;      // declared at 28
  hang.prev_step = 10;
  hang.why = "workers of node a failed: rank 0 made no progress";
  v.push_back(hang);
  LedgerPart resumed = Part("a", 3, 100, 101, 21, 1, 1);   // new agent after a suspend: no sign
  resumed.why = "resumed (suspended at step 20)";
  v.push_back(resumed);
  std::vector<LedgerEnd> ends = {{"a", 2, 40, "suspended"}, {"a", 3, 110, "complete"}};
  const LedgerReport r = Summarize(v, ends, 999);
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0].kind, "hang");
  EXPECT_DOUBLE_EQ(r.events[0].detection_s, 8);
  EXPECT_DOUBLE_EQ(r.events[0].rendezvous_s, 2);
  EXPECT_EQ(r.events[1].kind, "resume");
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("hung"), 8);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("suspended"), 60);    // 40 .. 100
  EXPECT_NEAR(Sum(r.totals), r.totals.wall_s, 1e-9);
  EXPECT_DOUBLE_EQ(r.totals.wall_s, 110);
}

TEST(LedgerTest, ARunningJobEndsNowAndPartsSurviveTheirEncoding) {
  std::vector<LedgerPart> v = {Part("a", 1, 0, 1, 1, 1, 1)};
  v[0].restored = 0.5;
  v[0].step_samples = 16;
  auto decoded = LedgerPart::Decode(v[0].Encode());
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->Encode(), v[0].Encode());
  EXPECT_FALSE(LedgerPart::Decode("{\"r\": \"x\"}").ok());
  EXPECT_FALSE(LedgerPart::Decode("not json").ok());
  const LedgerReport r = Summarize({*decoded}, {}, 50);
  EXPECT_FALSE(r.complete);
  EXPECT_DOUBLE_EQ(r.totals.wall_s, 50);
  EXPECT_DOUBLE_EQ(r.totals.seconds.at("training"), 49);
  EXPECT_NE(r.ToText(3).find("goodput 98.0% of 50 s (running)"), std::string::npos)
      << r.ToText(3);
}

TEST(LedgerTest, ReadLedgerReadsWhatNodesWroteAndSkipsDamagedRecords) {
  testing::MemoryEtcd etcd;
  for (const auto& p : Parts()) {
    ASSERT_TRUE(etcd.Put(LedgerPartKey("j", p.node, p.round), p.Encode()).ok());
  }
  const LedgerEnd end{"a", 3, 300, "complete"};
  ASSERT_TRUE(etcd.Put(LedgerEndKey("j", "a"), end.Encode()).ok());
  ASSERT_TRUE(etcd.Put(LedgerPrefix("j") + "x/r000000000009", "garbage").ok());
  auto r = ReadLedger(etcd, "j", 999);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->events.size(), 2u);
  EXPECT_TRUE(r->complete);
}

}  // namespace
}  // namespace efdl::rdzv
