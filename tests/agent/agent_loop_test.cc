// The agent's elastic loop against a scripted Rendezvous: the test double plays the other nodes
// and etcd; the workers are real processes.
#include "agent/agent.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/net.h"
#include "agent_loop_fixture.h"
#include "queued_rendezvous.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

// The fixture, its scripted Rendezvous and helpers (agent_loop_fixture.h, test_util.h).
using namespace testing;

TEST_F(AgentLoopTest, WorkersGetTheirPlaceAndCompletionExitsZero) {
  opts_.nproc = 2;
  opts_.command = {"sh", "-c", "env | sort > " + dir_.path() + "/env.$RANK"};
  CompleteTheJobAtASuccess();
  rdzv_.Push(Started(MakeAssignment(4, 1, 2, 3, 2, 5)));
  Agent agent(opts_, rdzv_);
  EXPECT_EQ(agent.Run(), 0);
  EXPECT_EQ(rdzv_.successes(), std::vector<int64_t>{4});
  EXPECT_TRUE(rdzv_.failures().empty());

  std::string env3 = ReadFile(dir_.path() + "/env.3");
  std::string env4 = ReadFile(dir_.path() + "/env.4");
  for (const char* kv : {"RANK=3\n", "LOCAL_RANK=0\n", "WORLD_SIZE=5\n", "LOCAL_WORLD_SIZE=2\n",
                         "GROUP_RANK=1\n", "NODE_RANK=1\n", "NNODES=2\n", "MASTER_ADDR=127.0.0.1\n",
                         "MASTER_PORT=29555\n", "EFDL_JOB_ID=job-1\n", "EFDL_ROUND=4\n",
                         "EFDL_RESTART_COUNT=0\n", "EFDL_NUM_MIN_WORKERS=1\n",
                         "EFDL_NUM_MAX_WORKERS=3\n", "EFDL_NODE_ID=node-a\n",
                         "TORCHELASTIC_RESTART_COUNT=0\n", "TORCHELASTIC_RUN_ID=job-1\n",
                         "TORCHELASTIC_USE_AGENT_STORE=False\n"}) {
    EXPECT_NE(env3.find(kv), std::string::npos) << kv;
  }
  EXPECT_NE(env3.find("EFDL_SNAPSHOT_DIR=" + opts_.snapshot_dir + "\n"), std::string::npos);
  EXPECT_NE(env3.find("EFDL_CONTROL_SOCKET=/"), std::string::npos);
  EXPECT_NE(env4.find("RANK=4\n"), std::string::npos);
  EXPECT_NE(env4.find("LOCAL_RANK=1\n"), std::string::npos);
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    EXPECT_NE(env3.find("OMP_NUM_THREADS=1\n"), std::string::npos);
  }
}

TEST_F(AgentLoopTest, InARoundThatMeetsInAnAgentStoreEveryRankIsItsClientUnderTheRoundNumber) {
  opts_.command = {"sh", "-c", "env | sort > " + dir_.path() + "/env.$RANK"};
  CompleteTheJobAtASuccess();
  Assignment a = MakeAssignment(7, 1, 2, 1, 1, 2);
  a.agent_store = true;
  rdzv_.Push(Started(a));
  Agent agent(opts_, rdzv_);
  EXPECT_EQ(agent.Run(), 0);
  const std::string env = ReadFile(dir_.path() + "/env.1");
  // This agent's first round, but torch's prefix for the round's keys must match the other
  // nodes' workers: the round number, not this agent's restart count.
  for (const char* kv : {"TORCHELASTIC_USE_AGENT_STORE=True\n", "TORCHELASTIC_RESTART_COUNT=7\n",
                         "EFDL_RESTART_COUNT=0\n", "MASTER_PORT=29555\n"}) {
    EXPECT_NE(env.find(kv), std::string::npos) << kv << env;
  }
}

TEST_F(AgentLoopTest, WorkerFailuresAreReportedAndCountedUntilMaxRestarts) {
  opts_.nproc = 2;
  opts_.max_restarts = 2;
  opts_.command = {"sh", "-c",
                   "if [ $RANK = 1 ]; then echo 'Traceback (most recent call last):' >&2; "
                   "echo 'ValueError: bad batch' >&2; echo 'a line on stdout'; exit 7; fi; "
                   "sleep 30"};
  rdzv_.on_failure = [&](int64_t round, const std::string&) {
    rdzv_.Push(Started(MakeAssignment(round + 1, 0, 1, 0, 2, 2)));
  };
  rdzv_.Push(Started(MakeAssignment(1, 0, 1, 0, 2, 2)));
  const Ran ran = RunAgent();
  const int code = ran.code;
  const std::string& text = ran.log;
  EXPECT_EQ(code, 1);
  EXPECT_EQ(ran.restarts, 3);
  ASSERT_EQ(rdzv_.failures().size(), 3u);
  EXPECT_EQ(rdzv_.failures()[0], "rank 1 exited with status 7");
  EXPECT_EQ(rdzv_.leaves(), 1);
  EXPECT_NE(text.find("giving up: rank 1 exited with status 7"), std::string::npos) << text;
  // The record for the other nodes and `efdl status` says why, in the program's own words.
  EXPECT_NE(rdzv_.gave_up().find("rank 1 exited with status 7"), std::string::npos);
  EXPECT_EQ(rdzv_.gave_up_tail(),
            (std::vector<std::string>{"Traceback (most recent call last):",
                                      "ValueError: bad batch"}));
}

// Issue #32, blame: a worker whose collective lost its peer (gloo's "Connection closed by peer")
// is not this node's failure and is not counted - but a streak of them, each within a minute of
// its round's start, is counted from 2x --max-restarts on (at least 6), so a node whose peers
// finished (or that breaks what it connects to) cannot go round for ever.
TEST_F(AgentLoopTest, CollateralFailuresAreNotCountedUntilAStreakOfThem) {
  opts_.nproc = 1;
  opts_.max_restarts = 2;
  opts_.exclude_after = 0;   // today's give-up rule (the exclusion tests are below)
  opts_.command = {"sh", "-c",
                   "echo 'RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
                   "Connection closed by peer [127.0.0.1]:4242' >&2; exit 1"};
  NextRoundAfterEachFailure();
  StartRoundOne();
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 1);
  const std::string& text = ran.log;
  // 6 collateral failures not counted, then 3 counted: the give-up at restart 3 of 2.
  EXPECT_EQ(rdzv_.failures().size(), 9u) << text;
  // Each reported as a lost peer: the round's reason does not call this node's workers failed.
  EXPECT_EQ(rdzv_.lost().size(), 9u) << text;
  EXPECT_EQ(ran.restarts, 3);
  EXPECT_NE(text.find("because a collective that lost a peer (Connection closed by peer): not "
                      "this node's failure"), std::string::npos) << text;
  EXPECT_NE(text.find("it is the 7th such failure in a row"), std::string::npos) << text;
  EXPECT_NE(text.find("giving up"), std::string::npos) << text;
}

// Issue #32, blame: only the error the worker died of decides. A worker whose tail still holds
// an earlier round's "Connection closed by peer" (under efdl.elastic.run it outlives such
// rounds) and then dies of its own exception is this node's failure.
TEST_F(AgentLoopTest, AWorkersOwnExceptionAfterAnEarlierLostPeerIsItsOwnFailure) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;
  opts_.exclude_after = 0;
  opts_.command = {"sh", "-c",
                   "echo 'RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
                   "Connection closed by peer [127.0.0.1]:4242' >&2; "
                   "echo 'Traceback (most recent call last):' >&2; "
                   "echo 'ValueError: bad batch' >&2; exit 1"};
  NextRoundAfterEachFailure();
  StartRoundOne();
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 1);
  const std::string& text = ran.log;
  EXPECT_EQ(rdzv_.failures().size(), 1u) << text;   // counted at once: --max-restarts 0
  EXPECT_TRUE(rdzv_.lost().empty()) << text;          // and reported as its own
  EXPECT_EQ(text.find("because a collective that lost a peer"), std::string::npos) << text;
}

// Issue #32, blame: workers that all exited 0 while their peers still trained broke the peers'
// collectives. The coordinator that forms the next round says so in this node's assignment
// (early_exit; coordination.h NameCause): the node counts that round as its own failure, named
// as such. Without the mark (the job's end, a join) the exit 0 counts for nothing.
TEST_F(AgentLoopTest, WorkersThatExitedZeroBeforeTheJobCompletedAreCountedWhenTheRoundSaysSo) {
  opts_.nproc = 2;
  opts_.max_restarts = 0;
  opts_.exclude_after = 0;
  opts_.command = {"sh", "-c", "exit 0"};
  rdzv_.on_success = [&](int64_t round) {
    if (round >= 3) {   // bounded even when the mark is ignored
      rdzv_.Push(Simple(Event::Type::kJobComplete, round));
      return;
    }
    Assignment next = MakeAssignment(round + 1, 1, 2, 2, 2, 4);
    next.early_exit = true;
    rdzv_.Push(Started(next));
  };
  rdzv_.Push(Started(MakeAssignment(1, 1, 2, 2, 2, 4)));
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 1);   // --max-restarts 0: the first own failure gives up
  const std::string& text = ran.log;
  EXPECT_EQ(rdzv_.exited0(), std::vector<std::string>{"ranks 2..3"}) << text;
  EXPECT_EQ(ran.restarts, 1) << text;
  EXPECT_NE(text.find("round 1: ranks 2..3 exited 0 before the job completed: their peers' "
                      "collectives lost them"), std::string::npos) << text;
  EXPECT_NE(rdzv_.gave_up().find("ranks 2..3 exited 0 before the job completed in round 1"),
            std::string::npos) << rdzv_.gave_up();
}

TEST_F(AgentLoopTest, WorkersThatExitedZeroAreNotCountedWithoutTheRoundsMark) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;
  opts_.exclude_after = 0;
  opts_.command = {"sh", "-c", "exit 0"};
  rdzv_.on_success = [&](int64_t round) {
    if (round == 1) {
      rdzv_.Push(Started(MakeAssignment(2, 0, 2, 0, 1, 2)));   // e.g. a node joined meanwhile
    } else {
      rdzv_.Push(Simple(Event::Type::kJobComplete, round));
    }
  };
  StartRoundOne();
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 0);
  EXPECT_EQ(ran.restarts, 0) << ran.log;
  EXPECT_EQ(rdzv_.exited0(), (std::vector<std::string>{"rank 0", "rank 0"}));
  EXPECT_EQ(ran.log.find("before the job completed"), std::string::npos) << ran.log;
}

// Issue #32, nodes that keep failing: the --exclude-after-th own failure within the window, in
// a job that can go on without the node (3 nodes, MIN 1), records the exclusion and withdraws
// for the cool-down instead of giving up; a round announced before the cool-down is over is
// not started; the first round after it gets fresh workers.
TEST_F(AgentLoopTest, ANodeWhoseOwnWorkersKeepFailingIsExcludedThenRejoins) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;    // would give up at the first failure: exclusion replaces that
  opts_.exclude_after = 2;
  opts_.exclude_cooldown = 400ms;
  const std::string ran = dir_.path() + "/ran";
  opts_.command = {"sh", "-c",
                   "echo $EFDL_ROUND >> " + ran + "; if [ $EFDL_ROUND -lt 3 ]; then "
                   "echo 'ValueError: bad host' >&2; exit 7; fi; exit 0"};
  NextRoundAfterEachFailure(3);
  std::thread later;
  rdzv_.on_withdraw = [&](std::chrono::milliseconds) {
    // Announced before the withdrawal took effect: stale, never started.
    rdzv_.Push(Started(MakeAssignment(4, 0, 2, 0, 1, 2)));
    later = std::thread([&] {
      std::this_thread::sleep_for(600ms);
      rdzv_.Push(Started(MakeAssignment(9, 2, 3, 2, 1, 3)));
    });
  };
  CompleteTheJobAtASuccess();
  StartRoundOne(3);
  StderrCapture log(dir_.path() + "/log");
  Agent agent(opts_, rdzv_);
  const int code = agent.Run();
  if (later.joinable()) later.join();
  const std::string text = log.Text();
  EXPECT_EQ(code, 0) << text;
  EXPECT_EQ(agent.exclusions(), 1);
  EXPECT_EQ(agent.restarts(), 2);
  EXPECT_EQ(rdzv_.leaves(), 0) << text;   // excluded, not gone
  EXPECT_TRUE(rdzv_.gave_up().empty());
  ASSERT_EQ(rdzv_.withdrawals().size(), 1u) << text;
  EXPECT_EQ(rdzv_.withdrawals()[0], 400ms);
  ASSERT_EQ(rdzv_.exclusions().size(), 1u);
  const rdzv::ExclusionRecord rec = rdzv_.exclusions()[0];
  EXPECT_EQ(rec.failures, 2);
  EXPECT_EQ(rec.exclusion, 1);
  EXPECT_FALSE(rec.until.empty());
  EXPECT_NE(rec.reason.find("rank 0 exited with status 7 in round 2"), std::string::npos)
      << rec.reason;
  EXPECT_EQ(rec.stderr_tail, std::vector<std::string>{"ValueError: bad host"});
  // Rounds 1 and 2 failed; round 3 (it withdrew from) and 4 (stale) never ran; 9 did.
  EXPECT_EQ(ReadFile(ran), "1\n2\n9\n") << text;
  EXPECT_NE(text.find("is excluded from job 'job-1' for 0.4 s (exclusion 1)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("is back in job 'job-1' after its cool-down"), std::string::npos) << text;
}

// Failures another node caused are never this node's: however many, no exclusion (fewer than
// the streak that counts them, kCollateralStreak).
TEST_F(AgentLoopTest, CollateralFailuresNeverExcludeTheNode) {
  opts_.nproc = 1;
  opts_.exclude_after = 1;
  opts_.command = {"sh", "-c",
                   "if [ $EFDL_ROUND -lt 6 ]; then echo 'RuntimeError: [../third_party/gloo/"
                   "gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                   "[127.0.0.1]:4242' >&2; exit 1; fi; exit 0"};
  NextRoundAfterEachFailure(3);
  CompleteTheJobAtASuccess();
  // Were it excluded, the script would have nothing more for it: end the run then.
  rdzv_.on_withdraw = [&](std::chrono::milliseconds) {
    rdzv_.Push(Simple(Event::Type::kFailed, 0, false, "excluded"));
  };
  StartRoundOne(3);
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 0);
  EXPECT_EQ(rdzv_.failures().size(), 5u);
  EXPECT_EQ(ran.restarts, 0);
  EXPECT_EQ(ran.exclusions, 0);
  EXPECT_TRUE(rdzv_.withdrawals().empty());
  EXPECT_TRUE(rdzv_.exclusions().empty());
}

// A streak of collateral failures ends when the job's node count changes (the node whose
// failures they were was excluded for them, or a node joined): 5 in 3-node rounds, then 5 in
// 2-node rounds are never counted, where 10 in a row would be from the 7th on.
TEST_F(AgentLoopTest, ACollateralStreakEndsWhenTheJobsNodeCountChanges) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;
  opts_.exclude_after = 0;
  opts_.command = {"sh", "-c",
                   "if [ $EFDL_ROUND -le 10 ]; then echo 'RuntimeError: [../third_party/gloo/"
                   "gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                   "[127.0.0.1]:4242' >&2; exit 1; fi; exit 0"};
  rdzv_.on_failure = [&](int64_t round, const std::string&) {
    const int nodes = round < 5 ? 3 : 2;
    rdzv_.Push(Started(MakeAssignment(round + 1, 0, nodes, 0, 1, nodes)));
  };
  CompleteTheJobAtASuccess();
  StartRoundOne(3);
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 0) << ran.log;
  EXPECT_EQ(rdzv_.failures().size(), 10u);
  EXPECT_EQ(ran.restarts, 0);
}

// Workers that fail at every round as gloo does when a peer's address is wrong: the agent says
// once which address was tried and what to set, however many rounds fail.
TEST_F(AgentLoopTest, PeerConnectFailuresAreExplainedOnceAcrossRestarts) {
  opts_.nproc = 1;
  opts_.max_restarts = 2;
  opts_.exclude_after = 0;   // gives up (the job could go on without it: it would be excluded)
  opts_.advertise_addr = "10.0.0.7";
  opts_.gloo_iface = "eth0";
  opts_.command = {"sh", "-c",
                   "echo 'RuntimeError: [pair.cc:799] connect [127.0.1.1]:4321: Connection "
                   "refused' >&2; exit 1"};
  NextRoundAfterEachFailure();
  StartRoundOne();
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 1);
  const std::string& text = ran.log;
  EXPECT_EQ(rdzv_.failures().size(), 3u);
  const std::string said = "rank 0 could not connect to a peer at 127.0.1.1:4321";
  const size_t at = text.find(said);
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_EQ(text.find(said, at + 1), std::string::npos) << text;   // once
  const std::string line = text.substr(at, text.find('\n', at) - at);
  EXPECT_NE(line.find("advertises 10.0.0.7"), std::string::npos) << line;
  EXPECT_NE(line.find("--iface NAME"), std::string::npos) << line;
  if (std::getenv("GLOO_SOCKET_IFNAME") == nullptr) {
    EXPECT_NE(line.find("GLOO_SOCKET_IFNAME=eth0"), std::string::npos) << line;
  }
  EXPECT_LT(at, text.find("giving up")) << text;
}

// A peer that died is refused too: a failure that came with a node leaving is not explained.
TEST_F(AgentLoopTest, PeerConnectFailureThatCameWithANodeLeavingIsNotExplained) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;
  opts_.command = {"sh", "-c",
                   "if [ $EFDL_ROUND = 1 ]; then echo 'connect [10.0.0.9]:4321: Connection "
                   "refused' >&2; exit 1; fi; exit 0"};
  rdzv_.on_failure = [&](int64_t, const std::string&) {
    rdzv_.Push(Started(MakeAssignment(2, 0, 2, 0, 1, 2)));  // 3 nodes -> 2
  };
  CompleteTheJobAtASuccess();
  StartRoundOne(3);
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 0);
  const std::string& text = ran.log;
  EXPECT_NE(text.find("came with a node leaving"), std::string::npos) << text;
  EXPECT_EQ(text.find("could not connect to a peer"), std::string::npos) << text;
}

TEST_F(AgentLoopTest, FailureThatCameWithANodeLeavingIsNotCounted) {
  opts_.nproc = 1;
  opts_.max_restarts = 0;
  std::string flag = dir_.path() + "/failed-once";
  // Fails in the first round only (a peer's death broke it), succeeds afterwards.
  opts_.command = {"sh", "-c", "if [ $EFDL_ROUND = 1 ]; then exit 1; fi; exit 0"};
  rdzv_.on_failure = [&](int64_t, const std::string&) {
    rdzv_.Push(Started(MakeAssignment(2, 0, 2, 0, 1, 2)));  // 3 nodes -> 2
  };
  CompleteTheJobAtASuccess();
  StartRoundOne(3);
  Agent agent(opts_, rdzv_);
  EXPECT_EQ(agent.Run(), 0);
  EXPECT_EQ(agent.restarts(), 0);
  EXPECT_EQ(rdzv_.failures().size(), 1u);
}

// A worker that failed on its own just before a peer's failure closed the round: its failure is
// this node's too (reported, so it counts), even though the closing event is handled before the
// agent's next look at its workers. Otherwise a program that fails on every node is counted
// only on the node whose failure was seen first, and the others wait out their join timeout
// (CI saw node-a wait 300 s).
TEST_F(AgentLoopTest, AWorkerThatFailedRightBeforeAPeersClosingIsStillReported) {
  opts_.nproc = 1;
  opts_.poll_interval = 30s;   // the agent looks at its workers only when an event wakes it
  const std::string go = dir_.path() + "/go";
  opts_.command = {"sh", "-c", "echo about to fail $$.; while [ ! -e " + go +
                                   " ]; do sleep 0.01; done; exit 3"};
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    const std::string said = "about to fail ";
    ASSERT_TRUE(WaitUntil([&] {
      const std::string out = Out();
      const size_t at = out.find(said);
      return at != std::string::npos && out.find('.', at) != std::string::npos;
    }));
    const std::string out = Out();
    const pid_t worker = std::stoi(out.substr(out.find(said) + said.size()));
    { std::ofstream(go) << "x"; }
    // The worker has exited 3 (a zombie: the agent has not looked) before the closing event:
    // waited for, not assumed after a fixed time a loaded machine can outlast.
    EXPECT_TRUE(WaitUntil([&] { return !testing::ProcessAlive(worker); }, 30s))
        << "the worker " << worker << " did not exit within 30 s";
    rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, false, "workers of node node-b failed"));
    rdzv_.Push(Simple(Event::Type::kJobComplete, 2));
  });
  agent.Run();
  script.join();
  ASSERT_EQ(rdzv_.failures().size(), 1u);
  EXPECT_EQ(rdzv_.failures()[0], "rank 0 exited with status 3");
}

TEST_F(AgentLoopTest, RoundClosingStopsWorkersAndTheNextRoundRestartsThem) {
  opts_.nproc = 1;
  opts_.command = {"sh", "-c", "echo \"started round $EFDL_ROUND restart $EFDL_RESTART_COUNT\"; "
                               "if [ $EFDL_ROUND = 1 ]; then exec sleep 30; fi"};
  CompleteTheJobAtASuccess();
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] { return Out().find("started round 1") != std::string::npos; }));
    rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node b joined"));
    rdzv_.Push(Started(MakeAssignment(2, 0, 3, 0, 1, 3)));
  });
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  // The plain `sleep` never connected to the socket: SIGTERM at once, not the 5 s grace.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  EXPECT_NE(Out().find("[rank 0] started round 2 restart 1"), std::string::npos) << Out();
  EXPECT_EQ(agent.restarts(), 0);  // membership changes never count
  EXPECT_TRUE(rdzv_.failures().empty());
}

TEST_F(AgentLoopTest, GracefulClosingReachesConnectedWorkersThroughTheSocket) {
  opts_.nproc = 1;
  std::string marker = dir_.path() + "/graceful";
  opts_.command = testing::PythonWorker(
      "import os, signal, sys, time\n"
      "from efdl import control\n"
      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(99))\n"
      "c = control.connect_from_env()\n"
      "if os.environ['EFDL_ROUND'] != '1': sys.exit(0)\n"
      "print('connected', flush=True)\n"
      "while not c.stop_requested(): time.sleep(0.002)\n"
      "c.notify_stopping(123)\n"
      "open('" + marker + "', 'w').write(c.stop_request().reason)\n");
  CompleteTheJobAtASuccess();
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] { return Out().find("connected") != std::string::npos; }, 20s));
    rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node c joined"));
    rdzv_.Push(Started(MakeAssignment(2, 0, 3, 0, 1, 3)));
  });
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  EXPECT_EQ(ReadFile(marker), "node c joined");
}

// A round-1 worker that answers the graceful stop, then is slow to exit (as an interpreter
// with torch loaded may), writing when it is really done; `gpu` fakes a process that may hold
// GPU memory. Round 2's worker writes when it started. The slow exit lasts until round 2's
// worker started (at most 60 s), so "round 2 started while round 1 still exited" does not
// depend on how fast this machine starts an interpreter; with `gpu` the agent must wait for the
// exit, so it ends after 1.5 s unless round 2 started before.
std::vector<std::string> SlowExitWorker(const std::string& dir, bool gpu) {
  return testing::PythonWorker(
      "import atexit, os, sys, time\n"
      "from efdl import control\n"
      "if os.environ['EFDL_ROUND'] != '1':\n"
      "    t = repr(time.time()); open('" + dir + "/round2-started', 'w').write(t); sys.exit(0)\n" +
      (gpu ? std::string("sys.modules['tensorflow'] = sys\n") : std::string()) +
      "c = control.connect_from_env()\n"
      "print('connected', flush=True)\n"
      "while not c.stop_requested(): time.sleep(0.002)\n"
      "c.notify_stopping(7)\n"
      "def slow_exit():\n"
      "    t = time.monotonic() + " + std::string(gpu ? "1.5" : "60") + "\n"
      "    while not os.path.exists('" + dir + "/round2-started') and time.monotonic() < t:\n"
      "        time.sleep(0.01)\n"
      "    open('" + dir + "/round1-exited', 'w').write(repr(time.time()))\n"
      "atexit.register(slow_exit)\n"
      "sys.exit(0)\n");
}

double ReadTime(const std::string& path) {
  const std::string text = ReadFile(path);
  return text.empty() ? 0.0 : std::stod(text);
}

// Runs round 1 with SlowExitWorker, a graceful close and round 2 to completion; returns when
// round 2's worker started and when round 1's had exited (wall seconds).
std::pair<double, double> RunGracefulChangeWithASlowExit(AgentOptions opts,
                                                         ScriptedRendezvous& rdzv,
                                                         const std::string& dir, bool gpu) {
  opts.nproc = 1;
  opts.command = SlowExitWorker(dir, gpu);
  rdzv.on_success = [&](int64_t round) { rdzv.Push(Simple(Event::Type::kJobComplete, round)); };
  rdzv.Push(Started(MakeAssignment(1, 0, 2, 0, 1, 2)));
  Agent agent(opts, rdzv);
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] {
      return ReadFile(dir + "/out").find("connected") != std::string::npos;
    }, 20s));
    rdzv.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node c joined"));
    rdzv.Push(Started(MakeAssignment(2, 0, 3, 0, 1, 3)));
  });
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  // Run() returns once round 2 completed and the old worker (if still exiting) was waited for.
  return {ReadTime(dir + "/round2-started"), ReadTime(dir + "/round1-exited")};
}

TEST_F(AgentLoopTest, GracefulClosingStartsTheNextRoundWhileTheOldWorkersExit) {
  const auto [started, exited] =
      RunGracefulChangeWithASlowExit(opts_, rdzv_, dir_.path(), /*gpu=*/false);
  ASSERT_GT(started, 0.0);
  // The old worker exits once round 2's started: an agent that waits for its exit instead
  // kills it after the stop grace, and it never writes that it exited.
  ASSERT_GT(exited, 0.0) << "the agent did not let the old worker finish its exit (it waited "
                            "for it instead of starting round 2, and killed it after the grace?)";
  EXPECT_LT(started, exited) << "round 2 waited for round 1's worker to exit";
}

TEST_F(AgentLoopTest, GracefulClosingWaitsForTheExitOfAWorkerThatMayHoldGpuMemory) {
  const auto [started, exited] =
      RunGracefulChangeWithASlowExit(opts_, rdzv_, dir_.path(), /*gpu=*/true);
  ASSERT_GT(started, 0.0);
  ASSERT_GT(exited, 0.0);
  EXPECT_GT(started, exited) << "round 2 started before a GPU worker of round 1 had exited";
}

TEST_F(AgentLoopTest, StandbyRunsNoWorkersUntilTakenIn) {
  opts_.nproc = 1;
  opts_.command = {"sh", "-c", "echo working in round $EFDL_ROUND"};
  Assignment standby;
  standby.round = 5;
  standby.standby = true;
  CompleteTheJobAtASuccess();
  rdzv_.Push(Started(standby));
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    std::this_thread::sleep_for(200ms);  // the agent idles as a standby meanwhile
    EXPECT_EQ(Out(), "");
    rdzv_.Push(Started(MakeAssignment(6, 2, 3, 2, 1, 3)));
  });
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  EXPECT_EQ(Out(), "[rank 2] working in round 6\n");
}

TEST_F(AgentLoopTest, FencedNodeStopsItsWorkersAndCanRejoin) {
  opts_.nproc = 1;
  opts_.command = {"sh", "-c", "echo pid $$ round $EFDL_ROUND; if [ $EFDL_ROUND = 1 ]; then exec sleep 30; fi"};
  CompleteTheJobAtASuccess();
  StartRoundOne();
  Agent agent(opts_, rdzv_);
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] { return Out().find("round 1") != std::string::npos; }));
    pid_t pid = std::stoi(Out().substr(Out().find("pid ") + 4));
    rdzv_.Push(Simple(Event::Type::kFenced, 1, false, "lease expired"));
    EXPECT_TRUE(WaitUntil([&] { return !testing::ProcessAlive(pid); }));
    rdzv_.Push(Started(MakeAssignment(3, 1, 2, 1, 1, 2)));
  });
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  EXPECT_NE(Out().find("[rank 1] pid"), std::string::npos);
  EXPECT_EQ(rdzv_.failures().size(), 0u);
}

TEST_F(AgentLoopTest, ShutdownStopsWorkersLeavesAndExitsWith128PlusSignal) {
  opts_.nproc = 2;
  opts_.command = {"sh", "-c", "echo pid $$; exec sleep 30"};
  rdzv_.Push(Started(MakeAssignment(1, 0, 1, 0, 2, 2)));
  Agent agent(opts_, rdzv_);
  std::vector<pid_t> pids;
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] {
      std::string o = Out();
      return o.find("[rank 0] pid") != std::string::npos && o.find("[rank 1] pid") != std::string::npos;
    }));
    std::string o = Out();
    for (size_t p = o.find("pid "); p != std::string::npos; p = o.find("pid ", p + 1)) {
      pids.push_back(std::stoi(o.substr(p + 4)));
    }
    agent.RequestShutdown(SIGTERM);
  });
  EXPECT_EQ(agent.Run(), 128 + SIGTERM);
  script.join();
  EXPECT_EQ(rdzv_.leaves(), 1);
  ASSERT_EQ(pids.size(), 2u);
  for (pid_t p : pids) EXPECT_FALSE(testing::ProcessAlive(p));
}

TEST_F(AgentLoopTest, FailedJobStopsWorkersAndExitsNonZero) {
  opts_.nproc = 1;
  opts_.command = {"sleep", "30"};
  rdzv_.Push(Started(MakeAssignment(1, 0, 1, 0, 1, 1)));
  rdzv_.Push(Simple(Event::Type::kFailed, 1, false, "below 2 nodes for 600 s"));
  Agent agent(opts_, rdzv_);
  EXPECT_EQ(agent.Run(), 1);
  EXPECT_EQ(rdzv_.leaves(), 1);
}

TEST_F(AgentLoopTest, JoinFailureEndsTheAgentWithItsMessage) {
  opts_.command = {"true"};
  rdzv_.FailJoin(Status::Unavailable("etcd at 127.0.0.1:1 did not answer"));
  const Ran ran = RunAgent();
  EXPECT_EQ(ran.code, 1);
  EXPECT_NE(ran.log.find("etcd at 127.0.0.1:1 did not answer"), std::string::npos);
}

TEST_F(AgentLoopTest, LauncherModeStartsOneProcessPerNodeAndStopsItsWholeGroup) {
  // A 2-process node at ranks 1..2 of world 3 (after a 1-process node): the one launcher
  // process gets node-level values and forks a child, as torchrun does with its workers.
  opts_.nproc = 2;
  opts_.launcher = true;
  const std::string d = dir_.path();
  opts_.command = {"sh", "-c", "env | sort > " + d + "/env.$EFDL_ROUND.$RANK; "
                               "if [ $EFDL_ROUND = 2 ]; then exit 0; fi; "
                               "sleep 300 & echo $! > " + d + "/child; wait"};
  CompleteTheJobAtASuccess();
  rdzv_.Push(Started(MakeAssignment(1, 1, 2, 1, 2, 3)));
  Agent agent(opts_, rdzv_);
  pid_t child = 0;
  std::thread script([&] {
    ASSERT_TRUE(WaitUntil([&] { return !ReadFile(d + "/child").empty(); }));
    child = std::stoi(ReadFile(d + "/child"));
    EXPECT_TRUE(testing::ProcessAlive(child));
    rdzv_.Push(Simple(Event::Type::kRoundClosing, 1, /*graceful=*/true, "node c joined"));
    rdzv_.Push(Started(MakeAssignment(2, 1, 2, 1, 2, 3)));
  });
  EXPECT_EQ(agent.Run(), 0);
  script.join();
  ASSERT_GT(child, 0);
  // The launcher's own child went with it on the round change: no orphan.
  EXPECT_TRUE(WaitUntil([&] { return !testing::ProcessAlive(child); }, 5s)) << child;
  std::string env = ReadFile(d + "/env.1.1");
  for (const char* kv : {"NNODES=2\n", "NODE_RANK=1\n", "NPROC_PER_NODE=2\n", "RANK=1\n",
                         "WORLD_SIZE=3\n", "MASTER_ADDR=127.0.0.1\n", "MASTER_PORT=29555\n",
                         "EFDL_NUM_MAX_WORKERS=3\n", "EFDL_LAUNCHER=1\n", "LOCAL_RANK=0\n",
                         "EFDL_ROUND=1\n"}) {
    EXPECT_NE(env.find(kv), std::string::npos) << kv << env;
  }
  EXPECT_EQ(env.find("EFDL_CONTROL_SOCKET="), std::string::npos) << env;
  EXPECT_EQ(ReadFile(d + "/env.1.2"), "");  // one process, not one per GPU
  EXPECT_NE(ReadFile(d + "/env.2.1").find("EFDL_RESTART_COUNT=1\n"), std::string::npos);
}

}  // namespace
}  // namespace efdl::agent
