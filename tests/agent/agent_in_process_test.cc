// In-process round changes (agent_in_process.cc) against a scripted Rendezvous: real worker
// processes that speak the control protocol as efdl.elastic.run does (python/efdl/control.py).
#include <signal.h>

#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "agent/agent.h"
#include "agent_loop_fixture.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

// The fixture, its scripted Rendezvous and helpers (agent_loop_fixture.h, test_util.h).
using namespace testing;

// A worker that takes round changes in-process: it writes "pid round rank" to
// DIR/worker.<local rank> at the start of each round it takes part in and prints a line; at a
// pause it says "paused" and waits for the next round's place; at a stop it exits 0. `extra` runs
// after the first line of round 1 (a failure report, or a hang that ignores pauses and SIGTERM).
std::vector<std::string> InProcessWorker(const std::string& dir, const std::string& extra = "") {
  return testing::PythonWorker(
      "import os, signal, sys, time\n"
      "from efdl import _place, control\n"
      "c = control.connect_from_env()\n"
      "c.announce_in_process()\n"
      "log = open('" + dir + "/worker.' + os.environ['LOCAL_RANK'], 'a')\n"
      "def note():\n"
      "    log.write('%d %d %s\\n' % (os.getpid(), c.round, os.environ['RANK'])); log.flush()\n"
      "    print('in round', c.round, flush=True)\n"
      "note()\n" + extra +
      "while True:\n"
      "    while c.pause_request() is None and c.stop_request() is None: time.sleep(0.002)\n"
      "    if c.stop_request() is not None: sys.exit(0)\n"
      "    c.notify_paused(5, snapshot=True)\n"
      "    place = c.wait_for_round()\n"
      "    if place is None: sys.exit(0)\n"
      "    _place.apply(place, c)\n"
      "    note()\n");
}

struct RoundLine {
  int pid = 0;
  int64_t round = 0;
  int rank = -1;
};

std::vector<RoundLine> RoundLines(const std::string& path) {
  std::vector<RoundLine> out;
  std::istringstream in(ReadFile(path));
  RoundLine l;
  while (in >> l.pid >> l.round >> l.rank) out.push_back(l);
  return out;
}

TEST_F(AgentLoopTest, InProcessWorkersArePausedAtACloseAndContinueWithTheNextRoundsPlace) {
  opts_.nproc = 2;
  opts_.command = InProcessWorker(dir_.path());
  const std::string w0 = dir_.path() + "/worker.0", w1 = dir_.path() + "/worker.1";
  rdzv_.Push(Started(MakeAssignment(1, 0, 1, 0, 2, 2)));
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    if (WaitUntil([&] { return RoundLines(w0).size() == 1 && RoundLines(w1).size() == 1; }, 20s)) {
      rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node b joined"));
      rdzv_.Push(Started(MakeAssignment(2, 1, 2, 2, 2, 4)));
      WaitUntil([&] { return RoundLines(w0).size() == 2 && RoundLines(w1).size() == 2; }, 20s);
    }
    agent.RequestShutdown(SIGTERM);   // whatever happened: the checks below say what
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  const auto l0 = RoundLines(w0), l1 = RoundLines(w1);
  ASSERT_EQ(l0.size(), 2u);
  ASSERT_EQ(l1.size(), 2u);
  EXPECT_EQ(l0[0].pid, l0[1].pid) << "the same process took part in both rounds";
  EXPECT_EQ(l1[0].pid, l1[1].pid);
  EXPECT_EQ(l0[1].round, 2);
  EXPECT_EQ(l0[0].rank, 0);
  EXPECT_EQ(l0[1].rank, 2) << "rank offset 2 in round 2";
  EXPECT_EQ(l1[1].rank, 3);
  const std::string out = Out();
  EXPECT_NE(out.find("[rank 3] in round 2"), std::string::npos)
      << "output lines carry the new rank: " << out;
  EXPECT_TRUE(rdzv_.failures().empty());
  EXPECT_EQ(agent.restarts(), 0);
}

TEST_F(AgentLoopTest, AnInProcessWorkerThatDoesNotPauseWithinTheGraceIsReplacedByANewOne) {
  opts_.nproc = 1;
  opts_.stop_grace = 500ms;
  // Round 1's worker is stuck (a collective waiting for a frozen peer): no pause, no SIGTERM.
  opts_.command = InProcessWorker(
      dir_.path(),
      "if c.round == 1:\n"
      "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
      "    while True: time.sleep(1)\n");
  const std::string w0 = dir_.path() + "/worker.0";
  testing::StderrCapture log(dir_.path() + "/agent.log");
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    if (WaitUntil([&] { return RoundLines(w0).size() == 1; }, 20s)) {
      rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/false, "node b was lost"));
      rdzv_.Push(Started(MakeAssignment(2, 0, 1, 0, 1, 1)));
      WaitUntil([&] { return RoundLines(w0).size() == 2; }, 20s);
    }
    agent.RequestShutdown(SIGTERM);
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  const auto lines = RoundLines(w0);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].pid, lines[1].pid) << "round 2 runs a new worker";
  EXPECT_EQ(lines[1].round, 2);
  EXPECT_FALSE(testing::ProcessAlive(lines[0].pid));
  const std::string text = log.Text();
  EXPECT_NE(text.find("local rank(s) 0 did not pause within 500 ms"), std::string::npos) << text;
}

TEST_F(AgentLoopTest, ACollectiveFailureReportedInProcessRedoesTheRoundWithTheSameWorkers) {
  opts_.nproc = 2;
  // Both local ranks see the failure (once both took part: a worker that has not said
  // in_process yet is restarted); the round is reported broken once.
  opts_.command = InProcessWorker(
      dir_.path(),
      "if c.round == 1:\n"
      "    while not all(os.path.exists('" + dir_.path() + "/worker.%d' % i) for i in (0, 1)):\n"
      "        time.sleep(0.005)\n"
      "    time.sleep(0.2)\n"
      "    c.notify_failed('RuntimeError: Connection closed by peer')\n");
  const std::string w0 = dir_.path() + "/worker.0", w1 = dir_.path() + "/worker.1";
  rdzv_.on_failure = [&](int64_t round, const std::string&) {
    // A peer node was lost with it: the next round has one node fewer.
    rdzv_.Push(Simple(Event::Type::kRoundClosing, round, /*graceful=*/false, "a worker failed"));
    rdzv_.Push(Started(MakeAssignment(round + 1, 0, 1, 0, 2, 2)));
  };
  rdzv_.Push(Started(MakeAssignment(1, 0, 2, 0, 2, 4)));
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    WaitUntil([&] { return RoundLines(w0).size() == 2 && RoundLines(w1).size() == 2; }, 20s);
    agent.RequestShutdown(SIGTERM);
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  ASSERT_EQ(rdzv_.failures().size(), 1u);
  EXPECT_NE(rdzv_.failures()[0].find("a collective failed (RuntimeError: Connection closed by "
                                     "peer)"), std::string::npos) << rdzv_.failures()[0];
  const auto l0 = RoundLines(w0);
  ASSERT_EQ(l0.size(), 2u);
  EXPECT_EQ(l0[0].pid, l0[1].pid);
  EXPECT_EQ(agent.restarts(), 0) << "a failure that came with a node leaving is not counted";
}

TEST_F(AgentLoopTest, AWorkerThatFailsInsteadOfPausingIsThisNodesFailure) {
  opts_.nproc = 1;
  // Round 1's worker exits 3 when asked to pause (its own error, not a peer's).
  opts_.command = InProcessWorker(
      dir_.path(),
      "if c.round == 1:\n"
      "    while c.pause_request() is None: time.sleep(0.002)\n"
      "    sys.exit(3)\n");
  const std::string w0 = dir_.path() + "/worker.0";
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    if (WaitUntil([&] { return RoundLines(w0).size() == 1; }, 20s)) {
      rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node c joined"));
      rdzv_.Push(Started(MakeAssignment(2, 0, 3, 0, 1, 3)));
      WaitUntil([&] { return RoundLines(w0).size() == 2; }, 20s);
    }
    agent.RequestShutdown(SIGTERM);
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  ASSERT_EQ(rdzv_.failures().size(), 1u);
  EXPECT_NE(rdzv_.failures()[0].find("exited with status 3"), std::string::npos)
      << rdzv_.failures()[0];
  EXPECT_EQ(agent.restarts(), 1) << "counted: no node left with it";
  EXPECT_EQ(RoundLines(w0).size(), 2u) << "round 2 started a new worker";
}

TEST_F(AgentLoopTest, PausedWorkersOfANodeThatBecomesAStandbyAreStopped) {
  opts_.nproc = 1;
  opts_.command = InProcessWorker(dir_.path());
  const std::string w0 = dir_.path() + "/worker.0";
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  int pid = 0;
  std::thread script([&] {
    if (WaitUntil([&] { return RoundLines(w0).size() == 1; }, 20s)) {
      pid = RoundLines(w0)[0].pid;
      rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node c joined"));
      Assignment standby = MakeAssignment(2, 0, 2, 0, 1, 2);
      standby.standby = true;
      rdzv_.Push(Started(standby));
      EXPECT_TRUE(WaitUntil([&] { return !testing::ProcessAlive(pid); }, 20s));
    }
    agent.RequestShutdown(SIGTERM);
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  EXPECT_NE(pid, 0);
  EXPECT_EQ(RoundLines(w0).size(), 1u);
  EXPECT_TRUE(rdzv_.failures().empty()) << "a paused worker told to stop exits 0";
}

}  // namespace
}  // namespace efdl::agent
