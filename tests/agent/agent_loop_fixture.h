// The agent loop's tests (agent_loop_test.cc, agent_in_process_test.cc): a scripted Rendezvous
// that plays the other nodes and etcd, event builders, and a fixture whose workers are real
// processes writing to a file of the test's temporary directory.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent/agent.h"
#include "common/net.h"
#include "queued_rendezvous.h"
#include "test_util.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent::testing {

using namespace std::chrono_literals;
using rdzv::Assignment;
using rdzv::Event;

class ScriptedRendezvous : public QueuedRendezvous {
 public:
  // Reactions the script runs (under no lock) when the agent reports.
  std::function<void(int64_t round, const std::string& detail)> on_failure;
  std::function<void(int64_t round)> on_success;

  void ReportWorkerFailure(int64_t round, const std::string& detail) override {
    {
      std::lock_guard lock(mu_);
      failures_.push_back(detail);
    }
    if (on_failure) on_failure(round, detail);
  }
  // Issue #32: a failure of a collective that lost its peer, and the ranks that exited 0, are
  // recorded as such and then reported as the plain calls above are.
  void ReportLostPeer(int64_t round, const std::string& detail, const std::string&) override {
    {
      std::lock_guard lock(mu_);
      lost_.push_back(detail);
    }
    ReportWorkerFailure(round, detail);
  }
  void ReportWorkersExited0(int64_t round, const std::string& ranks) override {
    {
      std::lock_guard lock(mu_);
      exited0_.push_back(ranks);
    }
    ReportWorkersSucceeded(round);
  }
  void ReportWorkersSucceeded(int64_t round) override {
    {
      std::lock_guard lock(mu_);
      successes_.push_back(round);
    }
    if (on_success) on_success(round);
  }
  void Leave() override {
    std::lock_guard lock(mu_);
    ++leaves_;
  }
  Status RecordGiveUp(const std::string& reason,
                      const std::vector<std::string>& stderr_tail) override {
    std::lock_guard lock(mu_);
    gave_up_ = reason;
    gave_up_tail_ = stderr_tail;
    return Status::OK();
  }

  Status RecordExclusion(const rdzv::ExclusionRecord& record) override {
    std::lock_guard lock(mu_);
    exclusions_.push_back(record);
    return Status::OK();
  }
  void Withdraw(std::chrono::milliseconds cooldown) override {
    {
      std::lock_guard lock(mu_);
      withdrawals_.push_back(cooldown);
    }
    if (on_withdraw) on_withdraw(cooldown);
  }
  std::function<void(std::chrono::milliseconds cooldown)> on_withdraw;

  std::vector<rdzv::ExclusionRecord> exclusions() const {
    std::lock_guard l(mu_);
    return exclusions_;
  }
  std::vector<std::chrono::milliseconds> withdrawals() const {
    std::lock_guard l(mu_);
    return withdrawals_;
  }
  std::vector<std::string> failures() const { std::lock_guard l(mu_); return failures_; }
  std::vector<int64_t> successes() const { std::lock_guard l(mu_); return successes_; }
  std::vector<std::string> lost() const { std::lock_guard l(mu_); return lost_; }
  std::vector<std::string> exited0() const { std::lock_guard l(mu_); return exited0_; }
  int leaves() const { std::lock_guard l(mu_); return leaves_; }
  std::string gave_up() const { std::lock_guard l(mu_); return gave_up_; }
  std::vector<std::string> gave_up_tail() const { std::lock_guard l(mu_); return gave_up_tail_; }

 private:
  mutable std::mutex mu_;   // guards the reports below
  std::vector<std::string> failures_;
  std::vector<int64_t> successes_;
  std::vector<std::string> lost_, exited0_;
  int leaves_ = 0;
  std::string gave_up_;
  std::vector<std::string> gave_up_tail_;
  std::vector<rdzv::ExclusionRecord> exclusions_;
  std::vector<std::chrono::milliseconds> withdrawals_;
};

inline Event Started(const Assignment& a) {
  Event e;
  e.type = Event::Type::kRoundStarted;
  e.round = a.round;
  e.assignment = a;
  return e;
}
inline Event Simple(Event::Type type, int64_t round, bool graceful = false, std::string msg = {}) {
  Event e;
  e.type = type;
  e.round = round;
  e.graceful = graceful;
  e.message = std::move(msg);
  return e;
}

// Sends the agent's log lines (fd 2) to a file for the test's lifetime.
class StderrCapture {
 public:
  explicit StderrCapture(std::string path) : path_(std::move(path)) {
    saved_ = ::dup(STDERR_FILENO);
    int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  ~StderrCapture() {
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  std::string Text() const { return ReadFile(path_); }

 private:
  std::string path_;
  int saved_ = -1;
};

class AgentLoopTest : public TempDirTest {
 protected:
  AgentLoopTest() : TempDirTest("efdl-agent-test") {}
  void SetUpInDir() override {
    out_fd_ = ::open((dir_.path() + "/out").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    opts_.job_id = "job-1";
    opts_.node_id = "node-a";
    opts_.min_nodes = 1;
    opts_.max_nodes = 3;
    opts_.snapshot_dir = dir_.path() + "/snap";
    opts_.stop_grace = 5s;
    opts_.poll_interval = 20ms;
    opts_.out_fd = out_fd_;
  }
  void TearDown() override { ::close(out_fd_); }
  std::string Out() const { return ReadFile(dir_.path() + "/out"); }

  // Script pieces for rounds of one-worker nodes with this node the first of `nodes`: round 1;
  // after each failed round the next one at the same place; a round's success completes the job.
  void StartRoundOne(int nodes = 2) {
    rdzv_.Push(Started(MakeAssignment(1, 0, nodes, 0, 1, nodes)));
  }
  void NextRoundAfterEachFailure(int nodes = 2) {
    rdzv_.on_failure = [this, nodes](int64_t round, const std::string&) {
      rdzv_.Push(Started(MakeAssignment(round + 1, 0, nodes, 0, 1, nodes)));
    };
  }
  void CompleteTheJobAtASuccess() {
    rdzv_.on_success = [this](int64_t round) {
      rdzv_.Push(Simple(Event::Type::kJobComplete, round));
    };
  }

  // One run of an agent over the scripted rounds: its exit code, what it logged, its counts.
  struct Ran {
    int code = 0;
    std::string log;
    int restarts = 0;
    int exclusions = 0;
  };
  Ran RunAgent() {
    StderrCapture log(dir_.path() + "/log");
    Agent agent(opts_, rdzv_);
    Ran ran;
    ran.code = agent.Run();
    ran.log = log.Text();
    ran.restarts = agent.restarts();
    ran.exclusions = agent.exclusions();
    return ran;
  }

  int out_fd_ = -1;
  AgentOptions opts_;
  ScriptedRendezvous rdzv_;
};

}  // namespace efdl::agent::testing
