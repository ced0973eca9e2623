// Suspend and resume (src/rendezvous/suspend.h): the records, and the protocol against a real
// etcd (started on free loopback ports in a temporary directory, stopped at the end) with real
// EtcdRendezvous nodes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "efdl/etcd.h"
#include "rendezvous/job_status.h"
#include "rendezvous/protocol.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "rendezvous/suspend.h"
#include "support/real_etcd_fixture.h"

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;

TEST(SuspendRecords, ReportRoundTripsWithAndWithoutStep) {
  SuspendReport with{int64_t{41}, "2026-01-01T00:00:00Z", std::nullopt, std::nullopt};
  auto back = SuspendReport::Decode(with.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->step, std::optional<int64_t>(41));
  EXPECT_EQ(back->time, "2026-01-01T00:00:00Z");
  auto none = SuspendReport::Decode(SuspendReport{}.Encode());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->step.has_value());
}

TEST(SuspendRecords, ReportRejectsBadValues) {
  for (const char* bad : {"[]", "{\"step\": -3}", "{\"step\": \"7\"}", "{\"t\": 5}", "garbage"}) {
    EXPECT_FALSE(SuspendReport::Decode(bad).ok()) << bad;
  }
}

TEST(SuspendRecords, SuspendedPhaseRoundTrips) {
  RoundRecord r;
  r.round = 7;
  r.phase = Phase::kSuspended;
  r.message = "suspended";
  auto back = RoundRecord::Decode(r.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->phase, Phase::kSuspended);
  EXPECT_STREQ(PhaseName(back->phase), "suspended");
  EXPECT_EQ(back->round, 7);
}

TEST(SuspendRecords, WithoutSequenceNumbersTheJobStepIsTheLargestReported) {
  std::map<std::string, SuspendReport> reports;
  EXPECT_FALSE(JobSuspendStep(reports).has_value());
  reports["b"] = SuspendReport{};  // a node whose workers do not write storage
  EXPECT_FALSE(JobSuspendStep(reports).has_value());
  reports["a"] = SuspendReport{int64_t{12}, "", std::nullopt, std::nullopt};
  reports["c"] = SuspendReport{int64_t{9}, "", std::nullopt, std::nullopt};
  EXPECT_EQ(JobSuspendStep(reports), std::optional<int64_t>(12));
  EXPECT_EQ(SuspendedJobMessage("j1", JobSuspendPoint(reports)),
            "job j1 is suspended at step 12; run `efdl resume --job j1` to continue");
  EXPECT_NE(SuspendedJobMessage("j1", std::nullopt).find("efdl resume --job j1"),
            std::string::npos);
}

TEST(SuspendRecords, TheJobResumesFromTheNewestSnapshotBySequenceNotTheLargestStep) {
  // Three nodes at the last epoch (issue #22): one persisted the end of epoch 5 (step 0, the
  // newest snapshot), one an older snapshot of epoch 4 at step 25, one nothing.
  std::map<std::string, SuspendReport> reports;
  reports["a"] = SuspendReport{int64_t{0}, "", uint64_t{57}, int64_t{5}};
  reports["b"] = SuspendReport{int64_t{25}, "", uint64_t{41}, int64_t{4}};
  reports["c"] = SuspendReport{};
  auto point = JobSuspendPoint(reports);
  ASSERT_TRUE(point);
  EXPECT_EQ(point->seq, std::optional<uint64_t>(57));
  EXPECT_EQ(JobSuspendStep(reports), std::optional<int64_t>(0));
  EXPECT_EQ(DescribeSuspendPoint(*point), "step 0 (epoch 5, snapshot 57)");
  EXPECT_EQ(SuspendedJobMessage("j", point),
            "job j is suspended at step 0 (epoch 5, snapshot 57); run `efdl resume --job j` to "
            "continue");
  // The report survives etcd (the new fields are optional for older agents' reports).
  auto back = SuspendReport::Decode(reports["a"].Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->seq, std::optional<uint64_t>(57));
  EXPECT_EQ(back->epoch, std::optional<int64_t>(5));
  auto old = SuspendReport::Decode(R"({"step":25,"t":"x"})");
  ASSERT_TRUE(old.ok());
  EXPECT_FALSE(old->seq.has_value());
}

class SuspendEtcdTest : public testing::RealEtcdRendezvousTest {
 protected:
  SuspendEtcdTest() : RealEtcdRendezvousTest("sjob", 200ms) {}
};

TEST_F(SuspendEtcdTest, UnknownAndCompleteJobsCannotBeSuspended) {
  auto missing = MarkSuspended(*client_, "nosuch");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();
  RoundRecord done;
  done.round = 3;
  done.phase = Phase::kComplete;
  ASSERT_TRUE(client_->Put(JobKeys("finished").round, done.Encode()).ok());
  auto complete = MarkSuspended(*client_, "finished");
  ASSERT_FALSE(complete.ok());
  EXPECT_TRUE(complete.status().IsFailedPrecondition());
  EXPECT_FALSE(ResumeJob(*client_, "finished").ok());  // not suspended
  EXPECT_TRUE(ResumeJob(*client_, "nosuch").status().IsNotFound());
}

TEST_F(SuspendEtcdTest, RunningNodesStopReportAndLeaveNewNodesAreRefusedUntilResume) {
  auto a = NewEtcdRendezvous(*client_, Opts("a", 2, 2));
  auto b = NewEtcdRendezvous(*client_, Opts("b", 2, 2));
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  auto ra = Next(*a, Event::Type::kRoundStarted);
  auto rb = Next(*b, Event::Type::kRoundStarted);
  ASSERT_TRUE(ra && rb);

  auto marked = MarkSuspended(*client_, "sjob");
  ASSERT_TRUE(marked.ok()) << marked.status().ToString();
  EXPECT_FALSE(marked->already);
  EXPECT_EQ(marked->round, ra->round);
  auto again = MarkSuspended(*client_, "sjob");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already);

  auto sa = Next(*a, Event::Type::kSuspended);
  auto sb = Next(*b, Event::Type::kSuspended);
  ASSERT_TRUE(sa && sb);
  EXPECT_TRUE(sa->graceful);
  EXPECT_EQ(sa->round, ra->round);

  // Until they leave, the nodes are still registered: resume must wait.
  auto info = ReadSuspension(*client_, "sjob");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->suspended());
  EXPECT_EQ(info->live_nodes.size(), 2u);
  EXPECT_TRUE(ResumeJob(*client_, "sjob").status().IsFailedPrecondition());

  ASSERT_TRUE(a->ReportSuspended(PersistedPoint{9, 37, int64_t{2}}).ok());
  ASSERT_TRUE(b->ReportSuspended(std::nullopt).ok());
  a->Leave();
  b->Leave();
  // No round forms after a node left a suspended job.
  EXPECT_FALSE(Next(*b, Event::Type::kRoundStarted, 1s));

  info = ReadSuspension(*client_, "sjob");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->live_nodes.empty());
  EXPECT_EQ(info->step, std::optional<int64_t>(37));
  ASSERT_EQ(info->reports.size(), 2u);
  EXPECT_FALSE(info->reports["b"].step.has_value());

  auto status = ReadJobStatus(*client_, "sjob");
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->suspended);
  EXPECT_EQ(status->phase, "suspended");
  EXPECT_EQ(status->suspended_step, std::optional<int64_t>(37));
  // The first line says what the job is (no "world size 0, 0 node(s), master :0").
  const std::string text = status->ToText();
  EXPECT_EQ(text.substr(0, text.find('\n')),
            fmt::format("job sjob: SUSPENDED after round {} at step 37 (epoch 2, snapshot 9); "
                        "`efdl resume --job sjob` continues it from there",
                        status->round))
      << text;
  EXPECT_EQ(text.find("master :0"), std::string::npos) << text;
  EXPECT_NE(status->ToJson().find("\"suspended_step\": 37"), std::string::npos);

  auto late = NewEtcdRendezvous(*client_, Opts("c", 1, 2));
  Status refused = late->Join();
  EXPECT_TRUE(refused.IsFailedPrecondition()) << refused.ToString();
  EXPECT_EQ(refused.message(),
            "job sjob is suspended at step 37 (epoch 2, snapshot 9); run `efdl resume --job "
            "sjob` to continue");
  info = ReadSuspension(*client_, "sjob");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->live_nodes.empty()) << "a refused node must not stay registered";

  auto resumed = ResumeJob(*client_, "sjob");
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ(*resumed, std::optional<int64_t>(37));
  status = ReadJobStatus(*client_, "sjob");
  ASSERT_TRUE(status.ok());
  EXPECT_FALSE(status->suspended);
  EXPECT_EQ(status->phase, "gathering");
  EXPECT_GT(status->round, ra->round);

  // Agents started again form a round (the first one takes over coordination).
  auto c = NewEtcdRendezvous(*client_, Opts("c", 2, 2));
  auto d = NewEtcdRendezvous(*client_, Opts("d", 2, 2));
  ASSERT_TRUE(c->Join().ok());
  ASSERT_TRUE(d->Join().ok());
  auto rc = Next(*c, Event::Type::kRoundStarted);
  auto rd = Next(*d, Event::Type::kRoundStarted);
  ASSERT_TRUE(rc && rd);
  EXPECT_EQ(rc->assignment.world_size, 2);
  EXPECT_GT(rc->round, ra->round);
  EXPECT_FALSE(rc->assignment.standby);
}

TEST_F(SuspendEtcdTest, SuspendWhileGatheringStopsWaitingNodes) {
  auto a = NewEtcdRendezvous(*client_, Opts("a", 2, 2));  // waits for a second node forever
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(MarkSuspended(*client_, "sjob").ok());
  ASSERT_TRUE(Next(*a, Event::Type::kSuspended));
  ASSERT_TRUE(a->ReportSuspended(std::nullopt).ok());
  a->Leave();
  auto info = ReadSuspension(*client_, "sjob");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->live_nodes.empty());
  EXPECT_FALSE(info->step.has_value());
}

}  // namespace
}  // namespace efdl::rdzv
