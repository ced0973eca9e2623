// RoundWorkers alone (issue #31 step 1; docs/agent.md): its control socket, a real WorkerGroup of
// shell workers, and, for what workers say on the control socket (in_process, paused,
// returned), a raw connection of the test standing in for each worker's control side; no Agent,
// no rendezvous.
#include "agent/round_workers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "control_conn.h"
#include "test_util.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using testing::ControlConn;
using testing::WaitUntil;
using nlohmann::json;

class RoundWorkersTest : public TempDirTest {
 protected:
  RoundWorkersTest() : TempDirTest("efdl-round-workers-test") {}
  void SetUpInDir() override {
    out_fd_ = ::open((dir_.path() + "/out").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    err_fd_ = ::open((dir_.path() + "/err").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    OpenWorkers("control.sock", 5s);
  }
  // RoundWorkers of job1/node-a in round 4, its control socket `sock` in the test's directory.
  void OpenWorkers(const std::string& sock, std::chrono::milliseconds stop_grace) {
    RoundWorkers::Config c;
    c.job_id = "job1";
    c.node_id = "node-a";
    c.control_socket_path = dir_.path() + "/" + sock;
    c.stop_grace = stop_grace;
    workers_ = std::make_unique<RoundWorkers>(c);
    ASSERT_TRUE(workers_->OpenControl().ok());
    workers_->SetRound(4);
  }
  void TearDown() override {
    workers_.reset();   // its workers and control socket first
    ::close(out_fd_);
    ::close(err_fd_);
  }
  // Starts `n` workers of round 4 running `script` (sh -c), ranks 10.., and hands them over.
  void Start(const std::string& script, int n) {
    WorkerGroupOptions o;
    o.argv = {"/bin/sh", "-c", script};
    o.round = 4;
    o.out_fd = out_fd_;
    o.err_fd = err_fd_;
    for (int lr = 0; lr < n; ++lr) o.workers.push_back({lr, 10 + lr, {}, ""});
    auto g = WorkerGroup::Start(std::move(o));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    workers_->Started(std::move(g).value());
  }
  // The control side of local rank `lr`'s worker: hello for round 4 (and "in_process").
  std::unique_ptr<ControlConn> Connect(int lr, bool in_process) {
    auto c = std::make_unique<ControlConn>(workers_->socket_path());
    EXPECT_TRUE(c->connected());
    EXPECT_TRUE(c->SendJson({{"type", "hello"}, {"pid", 1}, {"rank", 10 + lr},
                             {"local_rank", lr}, {"round", 4}}));
    EXPECT_EQ(c->ReadJson()["type"], "welcome");
    if (in_process) {
      EXPECT_TRUE(c->SendJson({{"type", "in_process"}}));
      EXPECT_EQ(c->ReadJson()["accepted"], true);
    }
    return c;
  }
  int out_fd_ = -1;
  int err_fd_ = -1;
  std::unique_ptr<RoundWorkers> workers_;
};

TEST(RoundWorkersSocketTest, WithoutAPathTheControlSocketIsInAPrivateDirectoryRemovedWithIt) {
  RoundWorkers::Config c;
  c.job_id = "job1";
  c.node_id = "node-a";
  std::filesystem::path socket;
  {
    RoundWorkers workers(c);
    EXPECT_EQ(workers.socket_path(), "");
    ASSERT_TRUE(workers.OpenControl().ok());
    socket = workers.socket_path();
    ASSERT_TRUE(std::filesystem::is_socket(socket)) << socket;
    struct stat st{};
    ASSERT_EQ(::stat(socket.parent_path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0077, 0u) << "the directory is the agent's alone";
    workers.Close();
    EXPECT_FALSE(std::filesystem::exists(socket)) << "Close() removes the socket";
  }
  EXPECT_FALSE(std::filesystem::exists(socket.parent_path()));
}

TEST_F(RoundWorkersTest, AStoppedFailedGroupLeavesTheFailingRanksStderrTail) {
  Start("echo 'peer at 10.0.0.9 gone' >&2; exit 3", 1);
  ASSERT_TRUE(WaitUntil([&] { return workers_->group()->Poll() == WorkerGroup::State::kFailed; }));
  workers_->Stop(/*graceful=*/false, "rank 10 exited with status 3");
  EXPECT_EQ(workers_->group(), nullptr);
  EXPECT_FALSE(workers_->active());
  EXPECT_EQ(workers_->last_stop().failure_tail,
            std::vector<std::string>{"peer at 10.0.0.9 gone"});
}

TEST_F(RoundWorkersTest, WorkersThatAllTakeRoundChangesInProcessPauseAndContinueInTheNextRound) {
  Start("sleep 30", 2);
  auto w0 = Connect(0, /*in_process=*/true);
  auto w1 = Connect(1, /*in_process=*/true);
  std::vector<int> unpaused{99};
  auto pausing = std::async(std::launch::async, [&] {
    return workers_->Pause(/*graceful=*/true, "scale out", unpaused, [] { return false; });
  });
  for (auto* w : {w0.get(), w1.get()}) {
    const json pause = w->ReadJson();
    EXPECT_EQ(pause["type"], "pause");
    EXPECT_EQ(pause["reason"], "scale out");
    ASSERT_TRUE(w->SendJson({{"type", "paused"}, {"step", 12}, {"snapshot", true}}));
  }
  ASSERT_TRUE(pausing.get());
  EXPECT_TRUE(unpaused.empty());
  EXPECT_TRUE(workers_->paused());
  EXPECT_FALSE(workers_->active());

  // Round 5 places this node's two workers at ranks 6 and 7.
  rdzv::Assignment next = testing::MakeAssignment(5, 1, 2, 6, 2, 8);
  workers_->SetRound(5);
  const std::string why = workers_->Continue(
      next, [](int lr) { return std::map<std::string, std::string>{{"X_LR", std::to_string(lr)}}; },
      {"", ""});
  EXPECT_EQ(why, "");
  for (int lr = 0; lr < 2; ++lr) {
    const json place = (lr == 0 ? w0 : w1)->ReadJson();
    EXPECT_EQ(place["type"], "round");
    EXPECT_EQ(place["round"], 5);
    EXPECT_EQ(place["rank"], 6 + lr);
    EXPECT_EQ(place["env"]["X_LR"], std::to_string(lr));
  }
  EXPECT_TRUE(workers_->active());
  EXPECT_EQ(workers_->group()->round(), 5);
}

TEST_F(RoundWorkersTest, WorkersNotAllInProcessAreNotPausedButStopped) {
  Start("sleep 30", 2);
  auto w0 = Connect(0, /*in_process=*/true);
  auto w1 = Connect(1, /*in_process=*/false);
  std::vector<int> unpaused;
  EXPECT_FALSE(workers_->Pause(false, "a peer failed", unpaused, [] { return false; }));
  EXPECT_TRUE(unpaused.empty());
  EXPECT_TRUE(workers_->active());
  EXPECT_EQ(w0->ReadLine(200ms), "<timeout>") << "no pause was sent";
}

TEST_F(RoundWorkersTest, APausedGroupCannotContinueWithAnotherWorkerCount) {
  Start("sleep 30", 1);
  auto w0 = Connect(0, /*in_process=*/true);
  std::vector<int> unpaused;
  auto pausing = std::async(std::launch::async, [&] {
    return workers_->Pause(true, "scale out", unpaused, [] { return false; });
  });
  EXPECT_EQ(w0->ReadJson()["type"], "pause");
  ASSERT_TRUE(w0->SendJson({{"type", "paused"}, {"step", 3}}));
  ASSERT_TRUE(pausing.get());
  const std::string why = workers_->Continue(
      testing::MakeAssignment(5, 0, 1, 0, 2, 2),
      [](int) { return std::map<std::string, std::string>{}; }, {"", ""});
  EXPECT_EQ(why, "this node runs 2 worker(s) now, 1 before");
  EXPECT_TRUE(workers_->paused()) << "the caller stops them";
}

TEST_F(RoundWorkersTest, AWorkerThatDoesNotPauseWithinTheGraceIsNamed) {
  ASSERT_NO_FATAL_FAILURE(OpenWorkers("control2.sock", 200ms));
  Start("sleep 30", 2);
  auto w0 = Connect(0, true);
  auto w1 = Connect(1, true);
  std::vector<int> unpaused;
  auto pausing = std::async(std::launch::async, [&] {
    return workers_->Pause(false, "a peer failed", unpaused, [] { return false; });
  });
  EXPECT_EQ(w0->ReadJson()["type"], "pause");
  ASSERT_TRUE(w0->SendJson({{"type", "paused"}, {"step", 3}}));
  EXPECT_FALSE(pausing.get());
  EXPECT_EQ(unpaused, std::vector<int>{1});
  EXPECT_FALSE(workers_->paused());
}

TEST_F(RoundWorkersTest, OneReturnedRankIsAnEarlyExitAndAllReturnedIsSaidOncePerRound) {
  Start("sleep 30", 2);
  auto w0 = Connect(0, true);
  auto w1 = Connect(1, true);
  ASSERT_TRUE(w1->SendJson({{"type", "returned"}}));
  ASSERT_TRUE(WaitUntil([&] { return workers_->EarlyExit0(10).has_value(); }));
  const WorkerExit early = *workers_->EarlyExit0(10);
  EXPECT_EQ(early.local_rank, 1);
  EXPECT_EQ(early.rank, 11);
  EXPECT_EQ(workers_->AllReturned(), std::nullopt);
  ASSERT_TRUE(w0->SendJson({{"type", "returned"}}));
  std::optional<int64_t> all;
  ASSERT_TRUE(WaitUntil([&] { return (all = workers_->AllReturned()).has_value(); }));
  EXPECT_EQ(*all, 4);
  EXPECT_EQ(workers_->AllReturned(), std::nullopt) << "said once";
  EXPECT_EQ(workers_->EarlyExit0(10), std::nullopt) << "all of them returned: the job's end";
}

TEST_F(RoundWorkersTest, WaitForOwnExitsSeesAWorkerThatFailsByItself) {
  Start("sleep 30", 1);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(workers_->WaitForOwnExits()) << "none exited by itself";
  EXPECT_GE(std::chrono::steady_clock::now() - start, RoundWorkers::kOwnExitWait);
  workers_->Stop(false, "next case");
  WorkerGroupOptions o;
  o.argv = {"/bin/sh", "-c", "sleep 0.2; exit 1"};
  o.round = 4;
  o.out_fd = out_fd_;
  o.err_fd = err_fd_;
  o.workers.push_back({0, 10, {}, ""});
  o.workers.push_back({1, 11, {}, ""});
  o.argv = {"/bin/sh", "-c", "[ \"$X_FAIL\" = 1 ] && { sleep 0.2; exit 1; }; sleep 30"};
  o.workers[1].env["X_FAIL"] = "1";
  auto g = WorkerGroup::Start(std::move(o));
  ASSERT_TRUE(g.ok());
  workers_->Started(std::move(g).value());
  EXPECT_TRUE(workers_->WaitForOwnExits());
  EXPECT_TRUE(workers_->group()->first_failure().has_value());
}

}  // namespace
}  // namespace efdl::agent
