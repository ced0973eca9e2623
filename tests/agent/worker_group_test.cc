#include "agent/worker_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "agent/control_server.h"
#include "agent/round_reports.h"
#include "common/net.h"
#include "test_util.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using testing::ReadFile;
using testing::WaitUntil;
using Clock = std::chrono::steady_clock;

class WorkerGroupTest : public TempDirTest {
 protected:
  WorkerGroupTest() : TempDirTest("efdl-wg-test") {}
  void SetUpInDir() override {
    out_fd_ = ::open((dir_.path() + "/out").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    err_fd_ = ::open((dir_.path() + "/err").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  void TearDown() override {
    ::close(out_fd_);
    ::close(err_fd_);
  }
  WorkerGroupOptions Options(std::vector<std::string> argv, int n, int64_t round = 1) {
    WorkerGroupOptions o;
    o.argv = std::move(argv);
    o.round = round;
    o.out_fd = out_fd_;
    o.err_fd = err_fd_;
    for (int i = 0; i < n; ++i) {
      WorkerSpec s;
      s.local_rank = i;
      s.rank = 10 + i;
      s.env["TEST_RANK"] = std::to_string(10 + i);
      o.workers.push_back(s);
    }
    return o;
  }
  std::unique_ptr<WorkerGroup> StartOk(WorkerGroupOptions o) {
    auto g = WorkerGroup::Start(std::move(o));
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? std::move(g).value() : nullptr;
  }
  static WorkerGroup::State WaitDone(WorkerGroup& g) {
    WorkerGroup::State s = WorkerGroup::State::kRunning;
    WaitUntil([&] { return (s = g.Poll()) != WorkerGroup::State::kRunning; });
    return s;
  }
  int out_fd_ = -1;
  int err_fd_ = -1;
};

TEST_F(WorkerGroupTest, AllWorkersExitingZeroIsSuccess) {
  auto g = StartOk(Options({"sh", "-c", "exit 0"}, 3));
  ASSERT_TRUE(g);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kSucceeded);
  EXPECT_EQ(g->running(), 0);
  EXPECT_FALSE(g->first_failure().has_value());
}

TEST_F(WorkerGroupTest, AWorkerThatExited0WhileAnotherRanIsRecordedAndAFailureAfterItToo) {
  // Rank 11 returns at once; rank 10 fails a moment later (its collective lost rank 11).
  auto g = StartOk(Options({"sh", "-c", "if [ $TEST_RANK = 11 ]; then exit 0; fi; sleep 0.5; "
                                        "exit 1"}, 2));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { g->Poll(); return g->exited0_early().has_value(); }));
  EXPECT_EQ(g->exited0_early()->rank, 11);
  EXPECT_EQ(g->first_exited0()->rank, 11);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kFailed);
  EXPECT_EQ(g->first_failure()->rank, 10);
  EXPECT_EQ(g->exited0_early()->rank, 11);

  // Exiting 0 after a failure: not early, but still the first exit 0.
  auto late = StartOk(Options({"sh", "-c", "if [ $TEST_RANK = 10 ]; then exit 1; fi; sleep 0.5; "
                                           "exit 0"}, 2));
  ASSERT_TRUE(late);
  EXPECT_EQ(WaitDone(*late), WorkerGroup::State::kFailed);
  ASSERT_TRUE(WaitUntil([&] { late->Poll(); return late->running() == 0; }));
  EXPECT_FALSE(late->exited0_early().has_value());
  ASSERT_TRUE(late->first_exited0().has_value());
  EXPECT_EQ(late->first_exited0()->rank, 11);
}

TEST_F(WorkerGroupTest, NonZeroExitIsReportedWithRankAndStatus) {
  auto g = StartOk(Options({"sh", "-c", "if [ $TEST_RANK = 11 ]; then exit 3; fi; sleep 30"}, 2));
  ASSERT_TRUE(g);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kFailed);
  ASSERT_TRUE(g->first_failure().has_value());
  EXPECT_EQ(g->first_failure()->rank, 11);
  EXPECT_EQ(g->first_failure()->local_rank, 1);
  EXPECT_EQ(DescribeWaitStatus(g->first_failure()->wait_status), "exited with status 3");
  EXPECT_EQ(g->running(), 1);  // the other one is still there until stopped
  g->Stop({false, "test", 2s}, nullptr);
  EXPECT_EQ(g->running(), 0);
}

TEST_F(WorkerGroupTest, OutputIsPrefixedWithTheRankLineByLine) {
  auto o = Options({"sh", "-c", "printf 'one\\ntwo\\n'; printf 'err line\\n' >&2; printf 'tail'"}, 1);
  o.workers[0].log_path = dir_.path() + "/logs/rank10.log";
  auto g = StartOk(std::move(o));
  ASSERT_TRUE(g);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kSucceeded);
  g.reset();  // joins the output thread
  EXPECT_EQ(ReadFile(dir_.path() + "/out"), "[rank 10] one\n[rank 10] two\n[rank 10] tail\n");
  EXPECT_EQ(ReadFile(dir_.path() + "/err"), "[rank 10] err line\n");
  std::string log = ReadFile(dir_.path() + "/logs/rank10.log");
  EXPECT_NE(log.find("one\ntwo\n"), std::string::npos);
  EXPECT_NE(log.find("err line\n"), std::string::npos);
  EXPECT_EQ(log.find("[rank"), std::string::npos);
}

TEST_F(WorkerGroupTest, LinesOfConcurrentWorkersNeverInterleave) {
  auto g = StartOk(Options(
      {"sh", "-c", "i=0; while [ $i -lt 200 ]; do echo \"line-$TEST_RANK-$i-xxxxxxxxxxxxxxxxxxxxxxxx\"; "
                   "i=$((i+1)); done"}, 3));
  ASSERT_TRUE(g);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kSucceeded);
  g.reset();
  std::string out = ReadFile(dir_.path() + "/out");
  size_t lines = 0, pos = 0, nl;
  while ((nl = out.find('\n', pos)) != std::string::npos) {
    std::string line = out.substr(pos, nl - pos);
    // "[rank R] line-R-i-xxx": the prefix names the writer of the line.
    ASSERT_EQ(line.substr(0, 6), "[rank ") << line;
    std::string rank = line.substr(6, 2);
    EXPECT_EQ(line.substr(10, 8), "line-" + rank + "-") << line;
    ++lines;
    pos = nl + 1;
  }
  EXPECT_EQ(lines, 600u);
}

TEST_F(WorkerGroupTest, WorkersGetTheirEnvironment) {
  auto o = Options({"sh", "-c", "echo \"$TEST_RANK $EXTRA\""}, 2);
  for (auto& w : o.workers) w.env["EXTRA"] = "x" + std::to_string(w.local_rank);
  auto g = StartOk(std::move(o));
  ASSERT_TRUE(g);
  EXPECT_EQ(WaitDone(*g), WorkerGroup::State::kSucceeded);
  g.reset();
  std::string out = ReadFile(dir_.path() + "/out");
  EXPECT_NE(out.find("[rank 10] 10 x0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 11] 11 x1\n"), std::string::npos) << out;
}

TEST_F(WorkerGroupTest, MissingProgramFailsToStart) {
  auto g = WorkerGroup::Start(Options({"efdl-no-such-worker-program"}, 2));
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("efdl-no-such-worker-program"), std::string::npos);
}

TEST_F(WorkerGroupTest, UnconnectedWorkerGetsSigtermAtOnceOnGracefulStop) {
  auto g = StartOk(Options({"sleep", "30"}, 2));
  ASSERT_TRUE(g);
  auto pids = g->pids();
  auto start = Clock::now();
  g->Stop({true, "test", 20s}, nullptr);
  EXPECT_LT(Clock::now() - start, 5s);  // nowhere near the grace period
  EXPECT_EQ(g->running(), 0);
  for (pid_t p : pids) EXPECT_FALSE(testing::ProcessAlive(p));
}

TEST_F(WorkerGroupTest, StopEscalatesToSigkillForAWorkerIgnoringSigterm) {
  auto g = StartOk(Options({"sh", "-c", "trap '' TERM; echo ready; while true; do sleep 0.05; done"}, 1));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return ReadFile(dir_.path() + "/out").find("ready") != std::string::npos; }));
  auto start = Clock::now();
  g->Stop({false, "test", 300ms}, nullptr);
  auto took = Clock::now() - start;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 5s);
  EXPECT_EQ(g->running(), 0);
}

TEST_F(WorkerGroupTest, ConnectedWorkerStopsThroughTheControlSocket) {
  auto server = ControlServer::Start({dir_.path() + "/control.sock", "job", "node"});
  ASSERT_TRUE(server.ok());
  (*server)->SetRound(4);
  ControlChannel channel(**server);
  std::string marker = dir_.path() + "/stopped-cleanly";
  auto o = Options(testing::PythonWorker(
      "import signal, time, sys\n"
      "from efdl import control\n"
      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(99))\n"
      "c = control.connect_from_env()\n"
      "step = 0\n"
      "while not c.stop_requested():\n"
      "    step += 1; time.sleep(0.001)\n"
      "req = c.stop_request()\n"
      "c.notify_stopping(step)\n"
      "open('" + marker + "', 'w').write('%s %s' % (req.graceful, req.reason))\n"), 1, 4);
  o.workers[0].env["EFDL_CONTROL_SOCKET"] = (*server)->path();
  o.workers[0].env["EFDL_ROUND"] = "4";
  o.workers[0].env["LOCAL_RANK"] = "0";
  auto g = StartOk(std::move(o));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return (*server)->IsConnected(4, 0); }, 20s));
  auto start = Clock::now();
  g->Stop({true, "scale out", 20s}, &channel);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_EQ(ReadFile(marker), "True scale out");
  EXPECT_EQ(channel.StoppingRanks(4), std::vector<int>{0});
  EXPECT_TRUE((*server)->newest_step().has_value());
}

// A worker that answers a graceful stop ("stopping", no GPU), then lingers: `tail` is Python
// run after the answer (its exit).
WorkerGroupOptions ConnectedWorker(WorkerGroupOptions o, const std::string& socket,
                                   const std::string& tail) {
  o.argv = testing::PythonWorker(
      "import signal, time, sys\n"
      "from efdl import control\n"
      "c = control.connect_from_env()\n"
      "while not c.stop_requested(): time.sleep(0.001)\n"
      "c.notify_stopping(5)\n" + tail);
  o.workers[0].env["EFDL_CONTROL_SOCKET"] = socket;
  o.workers[0].env["EFDL_ROUND"] = "4";
  o.workers[0].env["LOCAL_RANK"] = "0";
  return o;
}

TEST_F(WorkerGroupTest, AWorkerThatAnsweredAndHungUpBeforeTheStopIsNotSentSigterm) {
  // The stop reached the worker first (RequestStop), it answered and closed its connection on
  // its way out; Stop() then reaches no one, and must still give it the grace, not SIGTERM.
  auto server = ControlServer::Start({dir_.path() + "/control.sock", "job", "node"});
  ASSERT_TRUE(server.ok());
  (*server)->SetRound(4);
  ControlChannel channel(**server);
  const std::string marker = dir_.path() + "/sigterm";
  auto g = StartOk(ConnectedWorker(
      Options({}, 1, 4), (*server)->path(),
      "signal.signal(signal.SIGTERM, lambda *a: (open('" + marker + "', 'w').close(), "
      "sys.exit(143)))\n"
      "c.close()\n"
      "time.sleep(1.0)\n"));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return (*server)->IsConnected(4, 0); }, 20s));
  (*server)->RequestStop(4, true, "the first request");
  ASSERT_TRUE(WaitUntil([&] { return !(*server)->IsConnected(4, 0); }, 20s));
  ASSERT_EQ(channel.StoppingRanks(4), std::vector<int>{0});
  g->Stop({true, "leaving", 20s}, &channel);
  EXPECT_EQ(g->running(), 0);
  EXPECT_FALSE(std::filesystem::exists(marker)) << "the worker got SIGTERM";
  EXPECT_FALSE(g->first_failure().has_value());
}

TEST_F(WorkerGroupTest, AReleasingStopReturnsOnceTheWorkerAnsweredAndRetireReapsIt) {
  auto server = ControlServer::Start({dir_.path() + "/control.sock", "job", "node"});
  ASSERT_TRUE(server.ok());
  (*server)->SetRound(4);
  ControlChannel channel(**server);
  // The worker exits only once the test opens its gate (at most 60 s), so the checks of the
  // released, still running worker below do not race a fixed exit time on a loaded machine.
  const std::string gate = dir_.path() + "/gate";
  auto g = StartOk(ConnectedWorker(Options({}, 1, 4), (*server)->path(),
                                   "import os\n"
                                   "t = time.monotonic() + 60\n"
                                   "while not os.path.exists('" + gate +
                                       "') and time.monotonic() < t:\n"
                                   "    time.sleep(0.01)\n"));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return (*server)->IsConnected(4, 0); }, 20s));
  StopPolicy policy{true, "scale out", 20s, /*release_after_snapshot=*/true};
  g->Stop(policy, &channel);
  EXPECT_EQ(g->running(), 1) << "Stop() waited for the exit";
  EXPECT_EQ(channel.ReleasedRanks(4), std::vector<int>{0});
  EXPECT_FALSE(g->Retire());
  { std::ofstream(gate) << "1"; }
  EXPECT_TRUE(WaitUntil([&] { return g->Retire(); }, 10s));
  EXPECT_EQ(g->running(), 0);
  EXPECT_FALSE(g->first_failure().has_value());
}

TEST_F(WorkerGroupTest, ARetiringWorkerThatNeverExitsIsKilledAfterTheGrace) {
  auto server = ControlServer::Start({dir_.path() + "/control.sock", "job", "node"});
  ASSERT_TRUE(server.ok());
  (*server)->SetRound(4);
  ControlChannel channel(**server);
  auto g = StartOk(ConnectedWorker(Options({}, 1, 4), (*server)->path(),
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                   "while True: time.sleep(0.05)\n"));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return (*server)->IsConnected(4, 0); }, 20s));
  const pid_t pid = g->pids()[0];
  StopPolicy policy{true, "scale out", 300ms, /*release_after_snapshot=*/true};
  const auto start = Clock::now();
  g->Stop(policy, &channel);
  EXPECT_EQ(g->running(), 1);
  // SIGTERM (ignored) after the grace, SIGKILL after another.
  EXPECT_TRUE(WaitUntil([&] { return g->Retire(); }, 10s));
  EXPECT_GE(Clock::now() - start, 550ms);
  EXPECT_FALSE(testing::ProcessAlive(pid));
}

TEST_F(WorkerGroupTest, WithoutReleaseAStopWaitsForTheExitOfAWorkerThatAnswered) {
  auto server = ControlServer::Start({dir_.path() + "/control.sock", "job", "node"});
  ASSERT_TRUE(server.ok());
  (*server)->SetRound(4);
  ControlChannel channel(**server);
  auto g = StartOk(ConnectedWorker(Options({}, 1, 4), (*server)->path(), "time.sleep(0.5)\n"));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return (*server)->IsConnected(4, 0); }, 20s));
  g->Stop({true, "leaving", 20s}, &channel);
  EXPECT_EQ(g->running(), 0);
}

TEST_F(WorkerGroupTest, DestructionKillsRunningWorkersAndTheirChildren) {
  std::string pidfile = dir_.path() + "/grandchild";
  auto g = StartOk(Options({"sh", "-c", "sleep 30 & echo $! > " + pidfile + "; wait"}, 1));
  ASSERT_TRUE(g);
  ASSERT_TRUE(WaitUntil([&] { return !ReadFile(pidfile).empty(); }));
  pid_t grandchild = std::stoi(ReadFile(pidfile));
  pid_t child = g->pids()[0];
  g.reset();
  EXPECT_FALSE(testing::ProcessAlive(child));
  // The grandchild is reparented to init, which reaps it: it disappears shortly.
  EXPECT_TRUE(WaitUntil([&] { return !testing::ProcessAlive(grandchild); }));
}

}  // namespace
}  // namespace efdl::agent

namespace efdl::agent {
namespace {

// Workers must never outlive their agent: they get PR_SET_PDEATHSIG bound to the thread that
// started them, so that thread ending (as the agent's main thread does when the agent dies)
// kills them even though nobody stopped them.
TEST(WorkerGroupDeathTest, WorkersDieWithTheThreadThatStartedThem) {
  WorkerGroupOptions o;
  o.argv = {"sleep", "30"};
  o.workers.resize(2);
  o.workers[1].local_rank = o.workers[1].rank = 1;
  std::unique_ptr<WorkerGroup> group;
  std::thread spawner([&] {
    auto g = WorkerGroup::Start(o);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    group = std::move(g).value();
  });
  spawner.join();
  ASSERT_TRUE(group);
  WorkerGroup::State s = WorkerGroup::State::kRunning;
  ASSERT_TRUE(testing::WaitUntil([&] { return (s = group->Poll()) != WorkerGroup::State::kRunning; }));
  ASSERT_TRUE(group->first_failure().has_value());
  EXPECT_EQ(DescribeWaitStatus(group->first_failure()->wait_status),
            "killed by signal 9 (SIGKILL)");
}

}  // namespace
}  // namespace efdl::agent
