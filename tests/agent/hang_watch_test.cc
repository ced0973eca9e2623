// HangWatch alone (issue #31 step 1, issue #32): real python workers reporting on its progress
// board and then hanging (SIGSTOP, a sleep outside any collective, waiting in a gloo all-reduce
// for a peer of another "node"); the verdicts on this node, with the confirmation and the
// no-cause deadline driven by the times passed in.
#include "agent/hang_watch.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "health/progress_board.h"
#include "../support/spawn_python.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Kind = HangWatch::Verdict::Kind;

// Reports `STEPS` steps (each an all-reduce with WORLD set), then sleeps when it is the SLEEPER,
// else does one more all-reduce (which waits for the sleeper).
const char* kWorker = R"(
import os, sys, time
import efdl
def collective_step():
    if os.environ.get("WORLD"):
        import torch, torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(1))
for step in range(int(os.environ["STEPS"])):
    collective_step()
    efdl.progress(step=step)
    time.sleep(0.05)
if os.environ.get("SLEEPER") == os.environ["RANK"]:
    time.sleep(120)
else:
    collective_step()
)";

class HangWatchTest : public TempDirTest {
 protected:
  HangWatchTest() : TempDirTest("efdl-hang-watch-test") {}
  // The watch of job "j", node "n1": `nproc` local ranks, a 1 s hang timeout; each declaration
  // is recorded.
  std::unique_ptr<HangWatch> Watch(int nproc) {
    auto w = std::make_unique<HangWatch>(HangWatch::Config{
        .job_id = "j",
        .node_id = "n1",
        .nproc = nproc,
        .hang_timeout_s = 1.0,
        .on_declared = [this](Clock::time_point, double silent_s, bool own) {
          declared_.push_back({silent_s, own});
        }});
    w->Start(dir_.path());
    return w;
  }
  // A worker of global rank `rank`; `board`: it reports on the watch's board (slot `rank`).
  pid_t Spawn(const HangWatch& w, int rank, int world, int steps, int sleeper, bool board) {
    std::vector<std::string> env_s;
    env_s.push_back(std::string("PYTHONPATH=") + EFDL_TEST_PYTHONPATH);
    if (board) {
      health::HangMonitor& m = *w.monitor();
      env_s.push_back(std::string(health::kBoardEnv) + "=" + m.board_path());
      env_s.push_back(std::string(health::kSlotEnv) + "=" + std::to_string(rank));
      env_s.push_back(std::string(health::kStackDirEnv) + "=" + m.stack_dir());
      env_s.push_back(std::string(health::kStackSignalEnv) + "=" +
                      std::to_string(health::kStackSignal));
    }
    env_s.push_back("RANK=" + std::to_string(rank));
    env_s.push_back("WORLD_SIZE=" + std::to_string(world));
    env_s.push_back("STEPS=" + std::to_string(steps));
    env_s.push_back("SLEEPER=" + std::to_string(sleeper));
    if (world > 1) {
      env_s.push_back("WORLD=1");
      env_s.push_back("MASTER_ADDR=127.0.0.1");
      env_s.push_back("MASTER_PORT=" + std::to_string(26000 + ::getpid() % 3000));
      env_s.push_back("GLOO_SOCKET_IFNAME=lo");
    }
    const pid_t pid = testing_support::SpawnPython(kWorker, env_s);
    EXPECT_GT(pid, 0);
    children_.pids.push_back(pid);
    return pid;
  }
  // Checks (real time) until the watch declares a hang or gives a verdict; the last verdict.
  HangWatch::Verdict UntilDeclared(HangWatch& w, bool running = true) {
    const auto end = Clock::now() + 90s;
    const size_t before = declared_.size();
    HangWatch::Verdict v;
    while (Clock::now() < end && declared_.size() == before) {
      v = w.Check(Clock::now(), 7, 3, [running] { return running; });
      if (declared_.size() == before) std::this_thread::sleep_for(50ms);
    }
    EXPECT_GT(declared_.size(), before) << "no hang declared";
    return v;
  }

  struct Declared {
    double silent_s;
    bool own;
  };
  testing_support::Children children_;
  std::vector<Declared> declared_;
};

TEST_F(HangWatchTest, AStoppedRankOfThisNodeIsItsOwnHangAtOnce) {
  auto w = Watch(1);
  ASSERT_NE(w->monitor(), nullptr);
  const pid_t pid = Spawn(*w, 0, 1, 100000, -1, /*board=*/true);   // reports until stopped
  w->Arm({pid}, /*fresh=*/true);
  const auto end = Clock::now() + 60s;
  while (Clock::now() < end) {   // stopped once the board shows a few steps
    auto board = health::ProgressBoard::Open(w->monitor()->board_path());
    if (board.ok() && (*board)->Read(0).beats >= 3) break;
    std::this_thread::sleep_for(50ms);
  }
  ::kill(pid, SIGSTOP);
  const HangWatch::Verdict v = UntilDeclared(*w);
  EXPECT_EQ(v.kind, Kind::kOwn);
  EXPECT_NE(v.detail.find("rank 3 made no progress"), std::string::npos) << v.detail;
  ASSERT_EQ(declared_.size(), 1u);
  EXPECT_TRUE(declared_[0].own);
  EXPECT_GE(declared_[0].silent_s, 1.0);
  EXPECT_FALSE(w->monitor()->armed()) << "disarmed once declared";
}

TEST_F(HangWatchTest, ASleepingRankIsEndedOnceConfirmedStillRunning) {
  auto w = Watch(1);
  const pid_t pid = Spawn(*w, 0, 1, 5, /*sleeper=*/0, /*board=*/true);
  w->Arm({pid}, true);
  // Outside a collective in one sample: it may just be failing because another node ended its
  // culprit; until confirmed, a failure here is collateral.
  EXPECT_EQ(UntilDeclared(*w).kind, Kind::kNone);
  EXPECT_TRUE(declared_.back().own);
  EXPECT_TRUE(w->Stalled());
  const auto now = Clock::now();
  EXPECT_EQ(w->Check(now, 7, 3, [] { return true; }).kind, Kind::kNone) << "not confirmed yet";
  const HangWatch::Verdict v = w->Check(now + HangWatch::kConfirm, 7, 3, [] { return true; });
  EXPECT_EQ(v.kind, Kind::kOwn);
  EXPECT_NE(v.detail.find("rank 3 made no progress"), std::string::npos) << v.detail;
  EXPECT_FALSE(w->Stalled());
}

TEST_F(HangWatchTest, ASleepingRankWhoseWorkersStoppedRunningIsNotEnded) {
  auto w = Watch(1);
  const pid_t pid = Spawn(*w, 0, 1, 5, /*sleeper=*/0, /*board=*/true);
  w->Arm({pid}, true);
  EXPECT_EQ(UntilDeclared(*w).kind, Kind::kNone);
  // A worker failed meanwhile (its failure is the Agent's to take): nothing to end here.
  EXPECT_EQ(w->Check(Clock::now() + HangWatch::kConfirm, 7, 3, [] { return false; }).kind,
            Kind::kNone);
  EXPECT_FALSE(w->Stalled());
}

TEST_F(HangWatchTest, ACauseOnAnotherNodeIsWaitedForThenTheWorkersEndAnyway) {
  auto w = Watch(1);
  // This node's rank waits in an all-reduce for its peer, another node's rank that sleeps.
  const pid_t mine = Spawn(*w, 0, 2, 5, /*sleeper=*/1, /*board=*/true);
  Spawn(*w, 1, 2, 5, /*sleeper=*/1, /*board=*/false);
  w->Arm({mine}, true);
  EXPECT_EQ(UntilDeclared(*w).kind, Kind::kNone);
  EXPECT_FALSE(declared_.back().own);
  EXPECT_TRUE(w->Stalled()) << "a failure of this node's workers now is collateral";
  const auto now = Clock::now();
  EXPECT_EQ(w->Check(now, 7, 3, [] { return true; }).kind, Kind::kNone);
  // No progress within another timeout: this node ends its workers too.
  const HangWatch::Verdict v = w->Check(now + 1h, 7, 3, [] { return true; });
  EXPECT_EQ(v.kind, Kind::kNoCause);
  EXPECT_NE(v.detail.find("no node found the cause"), std::string::npos) << v.detail;
  // A new round's workers: nothing of that hang is kept.
  w->Arm({mine}, false);
  EXPECT_FALSE(w->Stalled());
}

}  // namespace
}  // namespace efdl::agent
