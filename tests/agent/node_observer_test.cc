// NodeObserver alone (issue #31 step 1, issue #33): one node's ledger parts on fake clocks, its
// workers' progress as a board would show it, the parts and ends recorded by an in-memory
// stand-in for the job's ledger/ records in etcd.
#include "agent/node_observer.h"

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "queued_rendezvous.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using RankSample = health::HangMonitor::RankSample;

// The ledger as etcd would hold it: every part and end written, in order.
class LedgerRendezvous : public testing::QueuedRendezvous {
 public:
  Status RecordLedger(const rdzv::LedgerPart& part) override {
    parts.push_back(part);
    return Status::OK();
  }
  Status RecordLedgerEnd(const rdzv::LedgerEnd& end) override {
    ends.push_back(end);
    return Status::OK();
  }
  std::vector<rdzv::LedgerPart> parts;
  std::vector<rdzv::LedgerEnd> ends;
};

// One node: its observer on fake clocks (wall seconds = 1000 + steady seconds since start;
// the board's monotonic clock in step) and two local ranks on a fake board.
class NodeObserverTest : public ::testing::Test {
 protected:
  NodeObserverTest() : observer_(Config(), rdzv_) {}

  NodeObserver::Config Config() {
    NodeObserver::Config c;
    c.node_id = "n1";
    c.min_nodes = 2;
    c.steady_now = [this] { return now_; };
    c.wall_now = [this] { return Wall(now_); };
    c.monotonic_ns = [this] { return static_cast<int64_t>(Seconds(now_) * 1e9); };
    return c;
  }
  double Seconds(Clock::time_point t) const {
    return std::chrono::duration<double>(t - start_).count();
  }
  double Wall(Clock::time_point t) const { return 1000 + Seconds(t); }
  void Advance(std::chrono::milliseconds d) { now_ += d; }

  // What the Agent would show: `board` (hang detection on), the workers armed and running.
  NodeObserver::Sight Sight(bool board = true) {
    NodeObserver::Sight s;
    s.board = board;
    s.armed = board;
    s.progress = [this] { return ranks_; };
    s.uncommitted = [this] { return uncommitted_; };
    return s;
  }
  // Local rank `lr` reported `step` `silent_s` ago, its last two reports `interval_s` apart.
  void Report(int lr, int64_t step, double silent_s = 0, double interval_s = 0.5,
              double restored_ago_s = -1) {
    RankSample& r = ranks_.at(lr);
    r.local_rank = lr;
    r.progressed = true;
    r.step = step;
    r.silent_s = silent_s;
    r.interval_s = interval_s;
    r.step_samples = 32;
    r.restored_ns = restored_ago_s < 0
                        ? 0
                        : static_cast<int64_t>((Seconds(now_) - restored_ago_s) * 1e9);
  }
  // Round `round` of `nnodes` nodes (2 ranks each) starts here, as Agent::StartRound tells it.
  void StartRound(int64_t round, int nnodes, const std::string& why, bool board = true) {
    rdzv::Assignment a;
    a.round = round;
    a.nnodes = nnodes;
    a.nproc = 2;
    a.world_size = 2 * nnodes;
    observer_.RoundStarts(a);
    observer_.BeginLedgerPart(a, why, Sight(board));
    ranks_.assign(2, RankSample{});   // a fresh start clears the slots
    ranks_[1].local_rank = 1;
  }

  Clock::time_point start_ = Clock::now();
  Clock::time_point now_ = start_;
  std::vector<RankSample> ranks_{2};
  int64_t uncommitted_ = -1;
  LedgerRendezvous rdzv_;
  NodeObserver observer_;
};

TEST_F(NodeObserverTest, APartIsWrittenOnceEveryLocalRankMadeProgress) {
  observer_.Joined();                 // wall 1000
  Advance(10s);
  StartRound(1, 2, "2 nodes joined");  // wall 1010
  Advance(3s);
  Report(0, 5, 0, 0.5, /*restored_ago_s=*/1);
  observer_.Update(Sight());
  EXPECT_TRUE(rdzv_.parts.empty()) << "rank 1 has not reported yet";
  Advance(1s);
  Report(1, 4, 0, 0.5, /*restored_ago_s=*/0.5);
  observer_.Update(Sight());
  observer_.Update(Sight());
  ASSERT_EQ(rdzv_.parts.size(), 1u);
  const rdzv::LedgerPart& p = rdzv_.parts[0];
  EXPECT_EQ(p.node, "n1");
  EXPECT_EQ(p.round, 1);
  EXPECT_EQ(p.world, 4);
  EXPECT_EQ(p.why, "2 nodes joined");
  EXPECT_DOUBLE_EQ(p.joined, 1000);
  EXPECT_DOUBLE_EQ(p.start, 1010);
  EXPECT_DOUBLE_EQ(p.progress, 1014);
  EXPECT_NEAR(p.restored, 1013.5, 1e-6);   // the last rank's restore
  EXPECT_EQ(p.step, 4);                    // the first step reported
  EXPECT_EQ(p.min_nodes, 2);
  EXPECT_EQ(p.prev_world, 0);
  EXPECT_EQ(p.uncommitted, -1);            // not read for the first round
}

TEST_F(NodeObserverTest, TheNextPartSaysHowTheChangeBeganAndOnlyIt) {
  observer_.Joined();
  StartRound(1, 2, "start");
  Advance(20s);
  Report(0, 100, /*silent_s=*/0.25, /*interval_s=*/0.5);
  Report(1, 101, /*silent_s=*/0.5, /*interval_s=*/0.7);
  observer_.Update(Sight());
  ASSERT_EQ(rdzv_.parts.size(), 1u);
  Advance(2s);
  Report(0, 103, 0.25, 0.5);
  Report(1, 104, 0.5, 0.7);
  observer_.RoundClosing(/*graceful=*/true, Sight());   // wall 1022
  Advance(4s);
  uncommitted_ = 3;
  StartRound(2, 1, "node n2 left");                     // wall 1026
  Advance(1s);
  Report(0, 101);
  Report(1, 101);
  observer_.Update(Sight());
  ASSERT_EQ(rdzv_.parts.size(), 2u);
  const rdzv::LedgerPart& p = rdzv_.parts[1];
  EXPECT_EQ(p.round, 2);
  EXPECT_EQ(p.why, "node n2 left");
  EXPECT_TRUE(p.graceful);
  EXPECT_DOUBLE_EQ(p.sign, 1022);
  EXPECT_DOUBLE_EQ(p.detection_s, 0);
  EXPECT_EQ(p.prev_step, 104);               // sampled as the change began
  EXPECT_DOUBLE_EQ(p.prev_at, 1022 - 0.25);  // the newest report
  EXPECT_DOUBLE_EQ(p.step_s, 0.7);           // the median interval
  EXPECT_DOUBLE_EQ(p.step_samples, 32);
  EXPECT_EQ(p.prev_world, 4);
  EXPECT_EQ(p.prev_nnodes, 2);
  EXPECT_EQ(p.uncommitted, 3);
  EXPECT_DOUBLE_EQ(p.joined, 0);             // only the first part says the join
  // A change with no sign here (a join elsewhere): nothing of the last one is said again.
  StartRound(3, 2, "node n2 joined");
  Advance(1s);
  Report(0, 102);
  Report(1, 102);
  observer_.Update(Sight());
  ASSERT_EQ(rdzv_.parts.size(), 3u);
  EXPECT_FALSE(rdzv_.parts[2].graceful);
  EXPECT_DOUBLE_EQ(rdzv_.parts[2].sign, 0);
}

TEST_F(NodeObserverTest, TheEarliestSignOfAChangeWins) {
  StartRound(1, 2, "start");
  Advance(30s);
  const Clock::time_point closing = now_;
  observer_.BeginPause(closing - 5s, Sight());   // a failure seen earlier
  observer_.BeginPause(closing, Sight());        // the round's close: later, ignored
  Advance(1s);
  // A hang whose silence began 7 s before it was seen: earlier still, and its detection.
  observer_.HangDeclared(closing, /*silent_s=*/7, /*own=*/true, Sight());
  StartRound(2, 2, "hang");
  Report(0, 1);
  Report(1, 1);
  observer_.Update(Sight());
  ASSERT_FALSE(rdzv_.parts.empty());
  const rdzv::LedgerPart& p = rdzv_.parts.back();
  EXPECT_EQ(p.round, 2);
  EXPECT_DOUBLE_EQ(p.sign, 1030 - 7);
  EXPECT_DOUBLE_EQ(p.detection_s, 7);
}

TEST_F(NodeObserverTest, ARoundThatEndsBeforeProgressIsWrittenAtItsEnd) {
  StartRound(1, 2, "start");
  Advance(2s);
  Report(0, 0);   // rank 1 never reports: it fails at its first step
  observer_.Update(Sight());
  EXPECT_TRUE(rdzv_.parts.empty());
  observer_.RoundClosing(/*graceful=*/false, Sight());
  ASSERT_EQ(rdzv_.parts.size(), 1u);
  EXPECT_TRUE(rdzv_.parts[0].ended_before_progress);
  EXPECT_DOUBLE_EQ(rdzv_.parts[0].progress, 0);
  observer_.Fenced(Sight());   // the pause already began: nothing more
  EXPECT_EQ(rdzv_.parts.size(), 1u);
}

TEST_F(NodeObserverTest, WithoutABoardAPartIsWrittenAtOnce) {
  StartRound(1, 2, "start", /*board=*/false);
  ASSERT_EQ(rdzv_.parts.size(), 1u);
  EXPECT_DOUBLE_EQ(rdzv_.parts[0].progress, 0);
  observer_.Update(Sight(/*board=*/false));
  observer_.BeginPause(now_, Sight(/*board=*/false));
  EXPECT_EQ(rdzv_.parts.size(), 1u);
}

TEST_F(NodeObserverTest, TheLedgerEndNamesTheNodesLastRound) {
  observer_.EndLedger("signal");
  EXPECT_TRUE(rdzv_.ends.empty()) << "no round took place here";
  StartRound(4, 2, "start");
  Advance(5s);
  observer_.EndLedger("complete");
  ASSERT_EQ(rdzv_.ends.size(), 1u);
  EXPECT_EQ(rdzv_.ends[0].node, "n1");
  EXPECT_EQ(rdzv_.ends[0].round, 4);
  EXPECT_EQ(rdzv_.ends[0].how, "complete");
  EXPECT_DOUBLE_EQ(rdzv_.ends[0].at, 1005);
}

}  // namespace
}  // namespace efdl::agent
