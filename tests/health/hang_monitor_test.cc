// The HangMonitor against real worker processes: Python programs that report progress through
// efdl's progress board, then hang (a sleep outside any collective, SIGSTOP, or waiting in a
// gloo all-reduce for a peer that sleeps).
#include "health/hang_monitor.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/net.h"
#include "../support/spawn_python.h"

namespace efdl::health {
namespace {

using namespace std::chrono_literals;

// A worker: reports `steps` steps, then runs `then` (Python) - all under efdl's arming.
const char* kWorker = R"(
import os, sys, time
import efdl
rank = int(os.environ["LOCAL_RANK"])
def collective_step():
    if os.environ.get("WORLD"):
        import torch, torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
for step in range(int(os.environ["STEPS"])):
    collective_step()
    efdl.progress(step=step)
    time.sleep(0.05)
sys.stdout.write("reported\n"); sys.stdout.flush()
if rank == int(os.environ.get("SLEEPER", "0")):
    time.sleep(120)
else:
    collective_step()
)";

class Workers {
 public:
  Workers(const HangMonitor& m, int n, int steps, bool world) {
    const uint16_t port = 29000 + static_cast<uint16_t>(::getpid() % 3000);
    for (int lr = 0; lr < n; ++lr) {
      std::vector<std::string> env_s;
      env_s.push_back(std::string("PYTHONPATH=") + EFDL_TEST_PYTHONPATH);
      env_s.push_back(std::string(kBoardEnv) + "=" + m.board_path());
      env_s.push_back(std::string(kSlotEnv) + "=" + std::to_string(lr));
      env_s.push_back(std::string(kStackDirEnv) + "=" + m.stack_dir());
      env_s.push_back(std::string(kStackSignalEnv) + "=" + std::to_string(kStackSignal));
      env_s.push_back("LOCAL_RANK=" + std::to_string(lr));
      env_s.push_back("RANK=" + std::to_string(lr));
      env_s.push_back("WORLD_SIZE=" + std::to_string(n));
      env_s.push_back("STEPS=" + std::to_string(steps));
      env_s.push_back("SLEEPER=" + std::to_string(n - 1));
      if (world) {
        env_s.push_back("WORLD=1");
        env_s.push_back("MASTER_ADDR=127.0.0.1");
        env_s.push_back("MASTER_PORT=" + std::to_string(port));
        env_s.push_back("GLOO_SOCKET_IFNAME=lo");
      }
      const pid_t pid = testing_support::SpawnPython(kWorker, env_s);
      EXPECT_GT(pid, 0);
      pids.push_back(pid);
    }
  }
  testing_support::Children children;
  std::vector<pid_t>& pids = children.pids;
};

// Checks until a hang is reported (or `limit`).
std::vector<HungRank> WaitForHang(HangMonitor& m, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    auto hung = m.Check();
    if (!hung.empty()) return hung;
    std::this_thread::sleep_for(50ms);
  }
  return {};
}

TEST(HangMonitorTest, SamplesPerStepAndARestoreOfThisRoundAreSeenAStaleRestoreIsNot) {
  auto dir = TempDir::Create("efdl-hang-test");
  ASSERT_TRUE(dir.ok());
  auto m = HangMonitor::Create(dir->path(), 1, {1.0});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto worker = ProgressBoard::Open((*m)->board_path());
  ASSERT_TRUE(worker.ok());
  (*m)->Arm({::getpid()}, /*fresh=*/true);
  (*worker)->Restored(0);
  (*worker)->Beat(0, 1, ::getpid(), 1, 64);   // the sampler handed out 64 so far
  ASSERT_EQ((*m)->Progress().size(), 1u);
  EXPECT_EQ((*m)->Progress()[0].step_samples, 0);   // one report: no growth seen yet
  EXPECT_GT((*m)->Progress()[0].restored_ns, 0);
  for (int i = 0; i < 3; ++i) (*worker)->Beat(0, 2 + i, ::getpid(), 1, 64 + 32 * (i + 1));
  EXPECT_DOUBLE_EQ((*m)->Progress()[0].step_samples, 32);
  // In-process continuation into the next round: the restore said before is the old round's.
  std::this_thread::sleep_for(2ms);
  (*m)->Arm({::getpid()}, /*fresh=*/false);
  EXPECT_EQ((*m)->Progress()[0].restored_ns, 0);
  (*worker)->Restored(0);
  EXPECT_GT((*m)->Progress()[0].restored_ns, 0);
  // Without a sampler's count (-1), samples per step stay unknown.
  (*m)->Arm({::getpid()}, /*fresh=*/true);
  (*worker)->Beat(0, 1, ::getpid(), 1, -1);
  (*worker)->Beat(0, 2, ::getpid(), 1, -1);
  EXPECT_EQ((*m)->Progress()[0].step_samples, 0);
}

TEST(HangMonitorTest, ARankSleepingOutsideACollectiveIsTheCauseAndItsStackIsWritten) {
  auto dir = TempDir::Create("efdl-hang-test");
  ASSERT_TRUE(dir.ok());
  auto m = HangMonitor::Create(dir->path(), 1, {1.0});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Workers w(**m, 1, 5, /*world=*/false);
  (*m)->Arm(w.pids, /*fresh=*/true);
  // The first-progress grace (300 s) must not fire while the interpreter starts; once the
  // worker reported, 1 s of silence does.
  auto hung = WaitForHang(**m, 60s);
  ASSERT_EQ(hung.size(), 1u);
  EXPECT_EQ(hung[0].local_rank, 0);
  EXPECT_EQ(hung[0].step, 4);
  EXPECT_GE(hung[0].silent_s, 1.0);
  auto stacks = (*m)->DumpStacks(2000ms);
  ASSERT_EQ(stacks.size(), 1u);
  EXPECT_TRUE(stacks[0].culprit);
  EXPECT_FALSE(stacks[0].in_collective);
  // The frame of the worker's `time.sleep(120)`.
  const std::string code = kWorker;
  const auto sleep_line =
      1 + std::count(code.begin(), code.begin() + code.find("time.sleep(120)"), '\n');
  EXPECT_NE(stacks[0].stack.find(fmt::format("line {} in <module>", sleep_line)), std::string::npos)
      << stacks[0].stack;
  EXPECT_TRUE((*m)->Check().empty()) << "reported once per arming";
}

TEST(HangMonitorTest, AStoppedWorkerIsNamedStoppedWithoutWaitingForItsStack) {
  auto dir = TempDir::Create("efdl-hang-test");
  ASSERT_TRUE(dir.ok());
  auto m = HangMonitor::Create(dir->path(), 1, {1.0});
  ASSERT_TRUE(m.ok());
  Workers w(**m, 1, 100000, /*world=*/false);   // reports until stopped
  (*m)->Arm(w.pids, true);
  const auto end = std::chrono::steady_clock::now() + 60s;
  while ((*m)->Check().empty() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(100ms);
    // Stop it once it has reported a few steps (the board shows it).
    auto board = ProgressBoard::Open((*m)->board_path());
    if (board.ok() && (*board)->Read(0).beats >= 3) {
      ::kill(w.pids[0], SIGSTOP);
      break;
    }
  }
  auto hung = WaitForHang(**m, 30s);
  ASSERT_EQ(hung.size(), 1u);
  const auto t0 = std::chrono::steady_clock::now();
  auto stacks = (*m)->DumpStacks(5000ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "a stopped process is not waited for";
  ASSERT_EQ(stacks.size(), 1u);
  EXPECT_EQ(stacks[0].state, 'T');
  EXPECT_TRUE(stacks[0].culprit);
  EXPECT_NE(stacks[0].why.find("stopped"), std::string::npos);
}

TEST(HangMonitorTest, RanksWaitingInAGlooAllReduceAreNotTheCauseTheSleepingPeerIs) {
  auto dir = TempDir::Create("efdl-hang-test");
  ASSERT_TRUE(dir.ok());
  auto m = HangMonitor::Create(dir->path(), 2, {1.0});
  ASSERT_TRUE(m.ok());
  Workers w(**m, 2, 5, /*world=*/true);   // rank 1 sleeps; rank 0 waits in all_reduce for it
  (*m)->Arm(w.pids, true);
  auto hung = WaitForHang(**m, 90s);
  ASSERT_FALSE(hung.empty());
  auto stacks = (*m)->DumpStacks(2000ms);
  ASSERT_EQ(stacks.size(), 2u);
  EXPECT_TRUE(stacks[0].in_collective) << stacks[0].stack;
  EXPECT_FALSE(stacks[0].culprit);
  EXPECT_FALSE(stacks[1].in_collective) << stacks[1].stack;
  EXPECT_TRUE(stacks[1].culprit);
}

}  // namespace
}  // namespace efdl::health
