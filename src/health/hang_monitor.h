// The HangMonitor: one agent's watch over its workers' progress (issue #32). It owns the node's
// progress board (progress_board.h), samples it on the agent's loop, judges each local rank by
// hang_rules.h, and, once a rank made no progress for its timeout, writes every local worker's
// Python stack and says which of them caused the hang.
//
// The agent arms it when a round's workers start (or continue in-process) and disarms it when
// they stop or pause; after a hang is reported it stays quiet until armed again.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efdl/status.h"
#include "health/hang_rules.h"
#include "health/progress_board.h"

namespace efdl::health {

struct HungRank {
  int local_rank = 0;
  double silent_s = 0;
  double limit_s = 0;
  int64_t step = -1;     // the step of its last report (-1: unknown)
};

// One local worker at a hang: its state and, when it could write it, its Python stack.
struct StackReport {
  int local_rank = 0;
  pid_t pid = 0;
  char state = '?';          // /proc/<pid>/stat
  std::string stack;         // faulthandler's dump ("" when none came)
  bool in_collective = false;
  // This worker is the hang's cause: stopped, in uninterruptible sleep, or (with a stack) not
  // waiting in a collective.
  bool culprit = false;
  std::string why;           // for the log: "stopped (SIGSTOP ...)", "not in a collective: ..."
};

class HangMonitor {
 public:
  // Creates the board `dir`/progress.board for `slots` local ranks; stacks go to `dir` too.
  static Result<std::unique_ptr<HangMonitor>> Create(const std::string& dir, int slots,
                                                     HangConfig config);

  const std::string& board_path() const { return board_->path(); }
  const std::string& stack_dir() const { return dir_; }
  const HangConfig& config() const { return config_; }

  // The round's workers (by local rank) start (`fresh`: new processes, their slots are cleared)
  // or continue in-process.
  void Arm(const std::vector<pid_t>& pids, bool fresh);
  void Disarm() { armed_ = false; }
  bool armed() const { return armed_; }

  // Samples the board; the ranks that made no progress for their timeout, once per arming.
  std::vector<HungRank> Check();
  // Every local rank has made no progress for at least `fraction` of its timeout (false when
  // not armed or nothing is judged): a worker failure now is the consequence of a hang whose
  // cause another node ended, not a failure of this node.
  bool Stalled(double fraction);

  // Writes each armed worker's Python stack (signal kStackSignal; waits up to `wait` for the
  // dumps) and judges which caused the hang.
  std::vector<StackReport> DumpStacks(std::chrono::milliseconds wait);

  // The running timeout in force now (for messages).
  double running_timeout_s() const;

  // Each armed rank's progress as the board shows it now (for the metrics); empty when not
  // armed.
  struct RankSample {
    int local_rank = 0;
    bool progressed = false;   // reported at least once since armed
    int64_t step = -1;
    double interval_s = 0;     // between its last two reports (0: not two yet)
    double silent_s = 0;       // since its last report, or since armed
    // Samples its samplers handed out per report recently (0: unknown; see ProgressSlot).
    double step_samples = 0;
    // CLOCK_MONOTONIC when its State said it restored in this arming's round (0: not yet).
    int64_t restored_ns = 0;
    // Its compute time per step as running totals (progress_board.h; the straggler rule).
    int64_t compute_ns = 0;
    int64_t compute_steps = 0;
  };
  std::vector<RankSample> Progress();
  // The most progress reports any rank of the last armed round made after its newest snapshot,
  // as the board holds them now (armed or not; -1: no rank said).
  int64_t Uncommitted() const;

 private:
  HangMonitor(std::string dir, std::unique_ptr<ProgressBoard> board, HangConfig config)
      : dir_(std::move(dir)), board_(std::move(board)), config_(config) {}
  void Sample();   // takes the board's new reports into ranks_ and intervals_

  struct Rank {
    pid_t pid = 0;
    uint64_t beats = 0;
    int64_t last_ns = 0;
    int64_t step = -1;
    double interval_s = 0;
    int64_t samples = -1;       // its samplers' count at its last report
    double step_samples = 0;
    RankTrack track;
  };
  std::string dir_;
  std::unique_ptr<ProgressBoard> board_;
  HangConfig config_;
  bool armed_ = false;
  int64_t armed_ns_ = 0;
  bool reported_ = false;
  bool program_reports_ = false;      // any rank ever reported (this agent's life)
  std::vector<Rank> ranks_;
  std::deque<double> intervals_;      // the node's recent intervals between reports, seconds
};

}  // namespace efdl::health
