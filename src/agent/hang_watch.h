// HangWatch: this node's part of hang detection (issue #32; issue #31 step 1; docs/operations.md
// "Hangs"). It owns the HangMonitor (the progress board and its judgement, src/health) and the
// state of a hang between loop turns: whether its cause is on another node (the workers' next
// failure is then collateral), the culprit of this node waiting for its confirmation, and the
// deadline after which this node ends its workers when no node found the cause.
//
// It decides and logs (the hung ranks, every local worker's stack, what this node does about
// it); the Agent acts on its Verdict: it ends this node's workers and records the failure (its
// own, or collateral of a hang whose cause no node found). When a hang is declared it calls the
// Config's on_declared (the Agent's NodeObserver), while the board still watches the workers.
//
// Single-threaded: called from the Agent's loop. Times are passed in.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "health/hang_monitor.h"

namespace efdl::agent {

class HangWatch {
 public:
  using Clock = std::chrono::steady_clock;
  // What the watch needs of the job and the node (from AgentOptions).
  struct Config {
    std::string job_id;
    std::string node_id;
    int nproc = 1;                 // local ranks: the board's slots
    double hang_timeout_s = -1;    // --hang-timeout: < 0 auto, > 0 the running timeout
    // A hang was declared at `seen` after `silent_s` without progress; `own`: a rank of this
    // node is its cause. Called before the monitor is disarmed. May be empty.
    std::function<void(Clock::time_point seen, double silent_s, bool own)> on_declared;
  };
  // What the Agent does about a hang on this turn.
  struct Verdict {
    enum class Kind {
      kNone,      // nothing (no hang, or waiting: for the culprit's node, for a confirmation)
      kOwn,       // a rank of this node caused it: end the workers, this node's failure
      kNoCause,   // no node found the cause in another timeout: end the workers, collateral
    };
    Kind kind = Kind::kNone;
    std::string detail;   // for the failure's record
  };
  // A failure of this node's workers after every local rank was silent this long (a fraction
  // of the hang timeout) is collateral of a hang another node ended.
  static constexpr double kCollateralStall = 0.8;
  // A culprit seen outside any collective is ended once still there after this long.
  static constexpr std::chrono::milliseconds kConfirm{1000};

  explicit HangWatch(Config config) : config_(std::move(config)) {}

  // Creates the board and the stack files in `dir`; a line and no detection when it cannot.
  void Start(const std::string& dir);
  // The monitor (null: detection off on this node), for those who read the board.
  health::HangMonitor* monitor() const { return monitor_.get(); }
  // The round's workers (`pids` by local rank; empty: none) started (`fresh`) or continue
  // in-process: a new watch, nothing of the last hang kept.
  void Arm(const std::vector<pid_t>& pids, bool fresh);
  // The workers stop or pause.
  void Disarm();
  // A failure of this node's workers now is collateral: the hang's cause is on another node, or
  // every local rank was silent for most of its timeout.
  bool Stalled();
  // One turn while the workers of `round` (global ranks from `rank_offset`) run and no failure
  // is pending. `running`: whether the workers still run (asked once a confirmed culprit is
  // alive).
  Verdict Check(Clock::time_point now, int64_t round, int rank_offset,
                const std::function<bool()>& running);

 private:
  // 5 members: the config, the monitor, and the hang's state between turns.
  const Config config_;
  std::unique_ptr<health::HangMonitor> monitor_;
  // A hang with no cause on this node: its workers' next failure is collateral; and when it
  // outlasts fallback_at_, this node's workers are ended too.
  bool elsewhere_ = false;
  std::optional<Clock::time_point> fallback_at_;
  // A rank of this node seen outside any collective at a hang, to be ended once confirmed.
  struct Confirm {
    Clock::time_point at;
    pid_t pid = 0;
    std::string detail;
  };
  std::optional<Confirm> confirm_;
};

}  // namespace efdl::agent
