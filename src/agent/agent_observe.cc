// What the agent observes of its node for others to read: its Prometheus metrics
// (src/metrics/agent_metrics.h) and its part of the job's goodput ledger (rendezvous/ledger.h),
// both issue #33: when a round change's pause began here, when the new round's workers made
// progress again, and which steps they trained again.
#include <algorithm>
#include <chrono>
#include <vector>

#include "agent/agent.h"
#include "common/log.h"

namespace efdl::agent {

namespace {

double WallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The wall time of a steady-clock instant in the past.
double WallOf(std::chrono::steady_clock::time_point at) {
  return WallNow() - std::chrono::duration<double>(std::chrono::steady_clock::now() - at).count();
}

}  // namespace

void Agent::BeginPause(std::chrono::steady_clock::time_point at) {
  if (pause_began_ && *pause_began_ <= at) return;
  SampleProgress();   // the last steps before the change: the next round may train them again
  pause_began_ = at;
  ledger_sign_ = WallOf(at);
  // The round ends before every local rank reported progress (with the board: its part was
  // not written yet): written now, so the ledger does not take its time for training.
  if (hang_ && ledger_part_ && ledger_part_->progress == 0 &&
      !ledger_part_->ended_before_progress) {
    ledger_part_->ended_before_progress = true;
    if (Status st = rdzv_.RecordLedger(*ledger_part_); !st.ok() && !ledger_warned_) {
      ledger_warned_ = true;
      EFDL_LOG_WARN("goodput ledger: {} (the job's events and goodput miss this node's parts)",
                    st.message());
    }
  }
}

void Agent::SampleProgress() {
  if (!hang_ || !group_ || group_paused_ || !hang_->armed()) return;
  const double now = WallNow();
  int64_t step = -1;
  double silent = -1;
  std::vector<double> intervals, samples;
  for (const auto& r : hang_->Progress()) {
    if (!r.progressed) continue;
    step = std::max(step, r.step);
    silent = silent < 0 ? r.silent_s : std::min(silent, r.silent_s);
    if (r.interval_s > 0) intervals.push_back(r.interval_s);
    if (r.step_samples > 0) samples.push_back(r.step_samples);
  }
  if (step < 0) return;
  last_step_ = step;
  last_step_at_ = now - silent;
  auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  if (!intervals.empty()) last_step_s_ = median(intervals);
  if (!samples.empty()) last_step_samples_ = median(samples);
}

void Agent::BeginLedgerPart(const rdzv::Assignment& a) {
  rdzv::LedgerPart p;
  p.node = options_.node_id;
  p.round = a.round;
  p.world = a.world_size;
  p.nnodes = a.nnodes;
  if (ledger_part_) {
    p.prev_world = ledger_part_->world;
    p.prev_nnodes = ledger_part_->nnodes;
  }
  p.why = round_why_;
  p.graceful = round_graceful_;
  p.sign = ledger_sign_;
  p.detection_s = ledger_detection_;
  p.start = WallNow();
  p.prev_step = last_step_;
  p.prev_at = last_step_at_;
  p.step_s = last_step_s_;
  p.step_samples = last_step_samples_;
  // What the previous round's ranks did after their newest snapshot: read before this round's
  // workers start (a fresh start clears their slots). Not for this node's first round.
  if (hang_ && rounds_started_ > 0) p.uncommitted = hang_->Uncommitted();
  p.min_nodes = options_.min_nodes;
  if (rounds_started_ == 0) p.joined = joined_at_;
  ledger_sign_ = 0;
  ledger_detection_ = 0;
  round_graceful_ = false;
  ledger_part_ = p;
  // Without a progress board (hang detection off, --launcher) the first progress cannot be
  // seen: the part goes now, its restore phase unknown (counted as training).
  if (!hang_) {
    if (Status st = rdzv_.RecordLedger(p); !st.ok() && !ledger_warned_) {
      ledger_warned_ = true;
      EFDL_LOG_WARN("goodput ledger: {} (the job's events and goodput miss this node's parts)",
                    st.message());
    }
  }
}

void Agent::EndLedger(const char* how) {
  if (!ledger_part_) return;
  rdzv::LedgerEnd end{options_.node_id, ledger_part_->round, WallNow(), how};
  if (Status st = rdzv_.RecordLedgerEnd(end); !st.ok()) {
    EFDL_LOG_WARN("goodput ledger: {}", st.message());
  }
}

void Agent::UpdateMetrics() {
  metrics::AgentMetrics* m = options_.metrics;
  const auto now = std::chrono::steady_clock::now();
  // The resume phase: from the new round's start until every local rank reported progress
  // (checked on each turn: it is a few reads of shared memory). Without a progress board (hang
  // detection off, --launcher) it cannot be seen and is not reported.
  if (resume_began_) {
    const bool watching = hang_ && group_ && !group_paused_ && hang_->armed();
    bool all = watching;
    int64_t first_step = -1;
    int64_t restored_ns = 0;   // the last rank's restore (0: a rank did not say)
    bool all_restored = true;
    if (watching) {
      for (const auto& r : hang_->Progress()) {
        all = all && r.progressed;
        if (r.progressed && r.step >= 0) {
          first_step = first_step < 0 ? r.step : std::min(first_step, r.step);
        }
        all_restored = all_restored && r.restored_ns > 0;
        restored_ns = std::max(restored_ns, r.restored_ns);
      }
    }
    if (all) {
      if (m != nullptr) {
        m->ObservePause(resume_phase_,
                        std::chrono::duration<double>(now - *resume_began_).count());
      }
      resume_began_.reset();
      if (ledger_part_ && ledger_part_->progress == 0) {
        ledger_part_->progress = WallNow();
        ledger_part_->step = first_step;
        if (all_restored && restored_ns > 0) {
          ledger_part_->restored = std::min(
              ledger_part_->progress,
              ledger_part_->progress -
                  static_cast<double>(health::MonotonicNanos() - restored_ns) / 1e9);
        }
        if (Status st = rdzv_.RecordLedger(*ledger_part_); !st.ok() && !ledger_warned_) {
          ledger_warned_ = true;
          EFDL_LOG_WARN("goodput ledger: {} (the job's events and goodput miss this node's "
                        "parts)", st.message());
        }
      }
    } else if (!watching) {
      resume_began_.reset();
    }
  }
  if (now < next_metrics_update_) return;
  next_metrics_update_ = now + std::chrono::seconds(1);
  SampleProgress();
  if (m == nullptr) return;
  if (restarts_ > restarts_in_metrics_) {
    m->CountRestarts(restarts_ - restarts_in_metrics_);
    restarts_in_metrics_ = restarts_;
  }
  std::vector<metrics::RankProgress> ranks;
  if (hang_ && group_ && hang_->armed()) {
    for (const auto& r : hang_->Progress()) {
      ranks.push_back({assignment_.rank_offset + r.local_rank, r.step, r.interval_s, r.silent_s});
    }
  }
  m->SetRankProgress(ranks);
  m->UpdateSnapshotAge(WallNow());
  // The job's goodput: one node (node rank 0 of a formed round) reads the ledger every 10 s.
  const bool rank0 = group_ && !assignment_.standby && assignment_.node_rank == 0;
  if (!rank0) {
    m->SetGoodput(false, 0, {});
  } else if (now >= next_goodput_) {
    next_goodput_ = now + std::chrono::seconds(10);
    if (auto report = rdzv_.ReadLedgerReport(); report.ok() && report->totals.wall_s > 0) {
      m->SetGoodput(true, report->totals.goodput(), report->totals.seconds);
    }
  }
}

}  // namespace efdl::agent
