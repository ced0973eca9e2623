// NodeObserver: what the agent observes of its node for others to read (issue #33; issue #31
// step 1): its Prometheus metrics (src/metrics/agent_metrics.h) and its part of the job's goodput
// ledger (rendezvous/ledger.h): when a round change's pause began here, when the new round's
// workers made progress again, which steps they trained again, and how the node left the job.
//
// It only observes and records: the Agent tells it what happens (a round closes or starts, a
// hang is declared, the node is fenced or leaves) and hands it, on every loop turn, a Sight of
// this node's workers (whether the progress board watches them, and how to read it). It never
// starts, stops or blames anything.
//
// Single-threaded: called from the Agent's loop. The clocks are in its Config (tests use fake
// ones).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "health/hang_monitor.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/ledger.h"
#include "rendezvous/rendezvous.h"

namespace efdl::agent {

class NodeObserver {
 public:
  using Clock = std::chrono::steady_clock;
  // What the observer needs of the job and the node (from AgentOptions), and its clocks.
  struct Config {
    std::string node_id;
    int min_nodes = 1;                           // --nnodes MIN, written in each ledger part
    metrics::AgentMetrics* metrics = nullptr;    // null: none
    std::function<Clock::time_point()> steady_now = [] { return Clock::now(); };
    // Wall seconds since the epoch (the ledger's times).
    std::function<double()> wall_now = [] {
      return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
          .count();
    };
    // CLOCK_MONOTONIC in ns: the clock of the board's restore times (RankSample::restored_ns).
    std::function<int64_t()> monotonic_ns = health::MonotonicNanos;
  };
  // What the Agent sees of this node's workers now; cheap to fill (the board is read only
  // through `progress` and `uncommitted`, and only when needed).
  struct Sight {
    // A progress board exists (hang detection on): progress can be seen. Without one the
    // resume phase is not reported and a ledger part is written as soon as it begins.
    bool board = false;
    // The board watches the round's workers (they run, or wait paused in-process).
    bool armed = false;
    bool paused = false;   // paused in-process at a round's close
    std::function<std::vector<health::HangMonitor::RankSample>()> progress;   // with armed
    // The most progress reports a rank of the last round made after its newest snapshot (-1:
    // none said); with board.
    std::function<int64_t()> uncommitted;
    int rank_offset = 0;   // this node's first global rank in the round
    // Node rank 0 of a formed round whose workers run here: it exports the job's goodput.
    bool rank0 = false;
    int restarts = 0;      // this node's own failures counted so far (Agent::restarts)

    bool watched() const { return board && armed && !paused; }
  };

  // Of `rendezvous` the observer calls only RecordLedger, RecordLedgerEnd and ReadLedgerReport;
  // it must outlive the observer.
  NodeObserver(Config config, rdzv::Rendezvous& rendezvous)
      : config_(std::move(config)), rdzv_(rendezvous) {}

  // This node joined the job (its first ledger part says when).
  void Joined();
  // A round change's pause begins at `at` (the earliest sign wins: a failure seen, a hang's
  // last progress, the round's close), unless one already began.
  void BeginPause(Clock::time_point at, const Sight& sight);
  // The round closes (`graceful`: an orderly change): counted, and its pause begins now.
  void RoundClosing(bool graceful, const Sight& sight);
  // This node lost its lease: counted, and the pause begins now.
  void Fenced(const Sight& sight);
  // A hang was seen at `seen` after `silent_s` without progress (`own`: a rank of this node
  // caused it): the pause began at the last progress; the detection took the silence.
  void HangDeclared(Clock::time_point seen, double silent_s, bool own, const Sight& sight);
  // Round `a` reached this node (standby included): the metrics' round, the end of the
  // rendezvous phase of the pause, the start of the resume phase.
  void RoundStarts(const rdzv::Assignment& a);
  // The ledger part of round `a` (`why`: the round's reason) whose workers start now or
  // continue in-process; not for a standby.
  void BeginLedgerPart(const rdzv::Assignment& a, const std::string& why, const Sight& sight);
  // This node leaves the job (`how`: complete, suspended, signal, failed): its ledger end, once
  // it took part in a round.
  void EndLedger(const char* how);
  // Every loop turn, cheap: the end of the resume phase (every local rank reported progress),
  // and about every second the slower gauges and the sample of the newest progress.
  void Update(const Sight& sight);

 private:
  // This node's newest progress (step, when) from the board, for the ledger.
  void SampleProgress(const Sight& sight);
  // Writes `part`; a failure is said once.
  void Record(const rdzv::LedgerPart& part);
  // The wall time of a steady-clock instant in the past.
  double WallOf(Clock::time_point at) const;

  // 13 members: the config and rendezvous, the pause's phases, the ledger's parts, the metrics'
  // schedule.
  const Config config_;
  rdzv::Rendezvous& rdzv_;
  // When the pause of the round change under way began; when this node's workers of the new
  // round started (their first progress report ends the pause) and which phase that is
  // ("startup": this node's first workers, else "resume").
  std::optional<Clock::time_point> pause_began_;
  std::optional<Clock::time_point> resume_began_;
  const char* resume_phase_ = "resume";
  // The ledger part of the newest round (written once every local rank reported progress), and
  // what the next one is to say of the change that ends it: the wall time of its first sign
  // here, a hang's silence, whether it was orderly.
  std::optional<rdzv::LedgerPart> ledger_part_;
  struct Change {
    double sign = 0;
    double detection_s = 0;
    bool graceful = false;
  } change_;
  // This node's newest progress: step, wall time of its report, seconds per step, samples per
  // rank per step (0: unknown).
  struct Seen {
    int64_t step = -1;
    double at = 0;
    double step_s = 0;
    double step_samples = 0;
  } seen_;
  double joined_at_ = 0;   // wall s of this node's join
  bool ledger_warned_ = false;
  // The restarts the metrics counted; the next update of the slower gauges; node rank 0: the
  // ledger's next read for the goodput.
  int restarts_in_metrics_ = 0;
  Clock::time_point next_metrics_update_{};
  Clock::time_point next_goodput_{};
};

}  // namespace efdl::agent
