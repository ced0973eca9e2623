// The agent's part of a suspend (kSuspended): stop the workers, read the newest persisted step
// from the job's storage, report it, leave, exit 0; and a refused join of a suspended job. The
// rendezvous is a small recording double; workers and snapshot files are real.
#include <gtest/gtest.h>

#include <mutex>

#include "agent/agent.h"
#include "common/net.h"
#include "queued_rendezvous.h"
#include "snapshot/layout.h"
#include "snapshot/snapshot_file.h"
#include "snapshot/store.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using rdzv::Event;

// Plays the rendezvous: the test queues events; the agent's reports are recorded.
class SuspendingRendezvous : public testing::QueuedRendezvous {
 public:
  explicit SuspendingRendezvous(Status join = Status::OK()) {
    if (!join.ok()) FailJoin(std::move(join));
  }
  void Leave() override {
    std::lock_guard lock(mu_);
    ++leaves;
  }
  Status ReportSuspended(const std::optional<rdzv::PersistedPoint>& point) override {
    std::lock_guard lock(mu_);
    reported.push_back(point ? std::optional<int64_t>(point->step) : std::nullopt);
    points.push_back(point);
    return Status::OK();
  }

  std::vector<std::optional<int64_t>> reported;
  std::vector<std::optional<rdzv::PersistedPoint>> points;   // read after Run() returned
  int leaves = 0;

 private:
  std::mutex mu_;
};

Event RoundOne() {
  Event e;
  e.type = Event::Type::kRoundStarted;
  e.round = 1;
  e.assignment.round = 1;
  e.assignment.nnodes = 1;
  e.assignment.nproc = 1;
  e.assignment.world_size = 1;
  e.assignment.master_addr = "127.0.0.1";
  e.assignment.master_port = 29555;
  return e;
}

Event Suspended() {
  Event e;
  e.type = Event::Type::kSuspended;
  e.round = 1;
  e.graceful = true;
  e.message = "suspended in round 1 by efdl suspend";
  return e;
}

void WriteSnapshot(const std::string& dir, uint64_t seq, int64_t step) {
  snapshot::SnapshotStore store(snapshot::Env::Posix(), dir, 4);
  snapshot::Manifest m;
  m.job = "sj";
  m.seq = seq;
  m.step = step;
  m.scope = "node";
  m.tensors = {{"model/w", "uint8", {64}, 0, 64}};
  m.data_bytes = snapshot::AssignOffsets(m.tensors);
  std::vector<uint8_t> data(m.data_bytes, 7);
  ASSERT_TRUE(store.Write(m, data.data(),
                          snapshot::ChecksumOfRegion(m.tensors, data.data(), nullptr)).ok());
}

AgentOptions Options(const std::string& snapshot_dir) {
  AgentOptions o;
  o.job_id = "sj";
  o.node_id = "n1";
  o.command = {"/bin/sleep", "60"};   // never connects: stopped with SIGTERM at once
  o.stop_grace = 5s;
  o.snapshot_dir = snapshot_dir;
  return o;
}

int RunSuspended(AgentOptions options, SuspendingRendezvous& rdzv) {
  rdzv.Push(RoundOne());
  rdzv.Push(Suspended());
  Agent agent(std::move(options), rdzv);
  return agent.Run();
}

// Each case's snapshot directory is its own temporary directory.
class AgentSuspend : public TempDirTest {
 protected:
  AgentSuspend() : TempDirTest("efdl-suspend-test") {}
};

TEST_F(AgentSuspend, ReportsTheNewestStepInStorageAndExitsZero) {
  WriteSnapshot(dir_.path() + "/sj", 1, 40);
  WriteSnapshot(dir_.path() + "/sj", 2, 45);
  SuspendingRendezvous rdzv;
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(RunSuspended(Options(dir_.path()), rdzv), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "SIGTERM, not the grace period";
  ASSERT_EQ(rdzv.reported.size(), 1u);
  EXPECT_EQ(rdzv.reported[0], std::optional<int64_t>(45));
  EXPECT_EQ(rdzv.leaves, 1);
}

TEST_F(AgentSuspend, PerRankSnapshotsReportTheOldestRanksNewestStep) {
  WriteSnapshot(dir_.path() + "/sj/rank-0", 1, 30);
  WriteSnapshot(dir_.path() + "/sj/rank-1", 1, 25);
  SuspendingRendezvous rdzv;
  EXPECT_EQ(RunSuspended(Options(dir_.path()), rdzv), 0);
  ASSERT_EQ(rdzv.reported.size(), 1u);
  EXPECT_EQ(rdzv.reported[0], std::optional<int64_t>(25));
}

TEST_F(AgentSuspend, WithoutASnapshotStillStopsAndReportsNone) {
  SuspendingRendezvous rdzv;
  EXPECT_EQ(RunSuspended(Options(dir_.path()), rdzv), 0);
  ASSERT_EQ(rdzv.reported.size(), 1u);
  EXPECT_FALSE(rdzv.reported[0].has_value());
  EXPECT_EQ(rdzv.leaves, 1);
}

TEST_F(AgentSuspend, AJobSuspendedBeforeTheStartIsRefused) {
  SuspendingRendezvous rdzv(Status::FailedPrecondition(
      "job sj is suspended at step 45; run `efdl resume --job sj` to continue"));
  Agent agent(Options(dir_.path()), rdzv);
  EXPECT_EQ(agent.Run(), 1);
  EXPECT_TRUE(rdzv.reported.empty());
}

}  // namespace
}  // namespace efdl::agent
