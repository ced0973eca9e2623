// NodeObserver (node_observer.h): the node's metrics and its part of the goodput ledger.
#include "agent/node_observer.h"

#include <algorithm>
#include <vector>

#include "common/log.h"

namespace efdl::agent {

double NodeObserver::WallOf(Clock::time_point at) const {
  return config_.wall_now() - std::chrono::duration<double>(config_.steady_now() - at).count();
}

void NodeObserver::Record(const rdzv::LedgerPart& part) {
  if (Status st = rdzv_.RecordLedger(part); !st.ok() && !ledger_warned_) {
    ledger_warned_ = true;
    EFDL_LOG_WARN("goodput ledger: {} (the job's events and goodput miss this node's parts)",
                  st.message());
  }
}

void NodeObserver::Joined() { joined_at_ = config_.wall_now(); }

void NodeObserver::BeginPause(Clock::time_point at, const Sight& sight) {
  if (pause_began_ && *pause_began_ <= at) return;
  SampleProgress(sight);   // the last steps before the change: the next round may train them again
  pause_began_ = at;
  change_.sign = WallOf(at);
  // The round ends before every local rank reported progress (with the board: its part was
  // not written yet): written now, so the ledger does not take its time for training.
  if (sight.board && ledger_part_ && ledger_part_->progress == 0 &&
      !ledger_part_->ended_before_progress) {
    ledger_part_->ended_before_progress = true;
    Record(*ledger_part_);
  }
}

void NodeObserver::RoundClosing(bool graceful, const Sight& sight) {
  if (config_.metrics) config_.metrics->CountRoundChange(graceful);
  BeginPause(config_.steady_now(), sight);
  change_.graceful = graceful;
}

void NodeObserver::Fenced(const Sight& sight) {
  if (config_.metrics) config_.metrics->CountFenced();
  BeginPause(config_.steady_now(), sight);
}

void NodeObserver::HangDeclared(Clock::time_point seen, double silent_s, bool own,
                                const Sight& sight) {
  BeginPause(seen - std::chrono::milliseconds(static_cast<int64_t>(silent_s * 1000)), sight);
  change_.detection_s = silent_s;
  if (config_.metrics) {
    config_.metrics->ObservePause("detection", silent_s);
    config_.metrics->CountHang(own);
  }
}

void NodeObserver::RoundStarts(const rdzv::Assignment& a) {
  const auto now = config_.steady_now();
  if (config_.metrics) {
    config_.metrics->SetRound(a.round, a.world_size, a.nnodes, a.nproc, a.standby);
    if (pause_began_) {
      config_.metrics->ObservePause(
          "rendezvous", std::chrono::duration<double>(now - *pause_began_).count());
    }
  }
  pause_began_.reset();
  // The resume phase ends at every local rank's first progress report (Update); this node's
  // first workers are its start-up instead.
  resume_began_.reset();
  if (!a.standby) resume_began_ = now;
  resume_phase_ = ledger_part_ ? "resume" : "startup";
}

void NodeObserver::SampleProgress(const Sight& sight) {
  if (!sight.watched()) return;
  const double now = config_.wall_now();
  int64_t step = -1;
  double silent = -1;
  std::vector<double> intervals, samples;
  for (const auto& r : sight.progress()) {
    if (!r.progressed) continue;
    step = std::max(step, r.step);
    silent = silent < 0 ? r.silent_s : std::min(silent, r.silent_s);
    if (r.interval_s > 0) intervals.push_back(r.interval_s);
    if (r.step_samples > 0) samples.push_back(r.step_samples);
  }
  if (step < 0) return;
  seen_.step = step;
  seen_.at = now - silent;
  auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  if (!intervals.empty()) seen_.step_s = median(intervals);
  if (!samples.empty()) seen_.step_samples = median(samples);
}

void NodeObserver::BeginLedgerPart(const rdzv::Assignment& a, const std::string& why,
                                   const Sight& sight) {
  rdzv::LedgerPart p;
  p.node = config_.node_id;
  p.round = a.round;
  p.world = a.world_size;
  p.nnodes = a.nnodes;
  if (ledger_part_) {
    p.prev_world = ledger_part_->world;
    p.prev_nnodes = ledger_part_->nnodes;
  }
  p.why = why;
  p.graceful = change_.graceful;
  p.sign = change_.sign;
  p.detection_s = change_.detection_s;
  p.start = config_.wall_now();
  p.prev_step = seen_.step;
  p.prev_at = seen_.at;
  p.step_s = seen_.step_s;
  p.step_samples = seen_.step_samples;
  // What the previous round's ranks did after their newest snapshot: read before this round's
  // workers start (a fresh start clears their slots). Not for this node's first round.
  if (sight.board && ledger_part_) p.uncommitted = sight.uncommitted();
  p.min_nodes = config_.min_nodes;
  if (!ledger_part_) p.joined = joined_at_;
  change_ = {};
  ledger_part_ = p;
  // Without a progress board (hang detection off, --launcher) the first progress cannot be
  // seen: the part goes now, its restore phase unknown (counted as training).
  if (!sight.board) Record(p);
}

void NodeObserver::EndLedger(const char* how) {
  if (!ledger_part_) return;
  rdzv::LedgerEnd end{config_.node_id, ledger_part_->round, config_.wall_now(), how};
  if (Status st = rdzv_.RecordLedgerEnd(end); !st.ok()) {
    EFDL_LOG_WARN("goodput ledger: {}", st.message());
  }
}

void NodeObserver::Update(const Sight& sight) {
  metrics::AgentMetrics* m = config_.metrics;
  const auto now = config_.steady_now();
  // The resume phase: from the new round's start until every local rank reported progress
  // (checked on each turn: it is a few reads of shared memory). Without a progress board (hang
  // detection off, --launcher) it cannot be seen and is not reported.
  if (resume_began_) {
    const bool watching = sight.watched();
    bool all = watching;
    int64_t first_step = -1;
    int64_t restored_ns = 0;   // the last rank's restore (0: a rank did not say)
    bool all_restored = true;
    if (watching) {
      for (const auto& r : sight.progress()) {
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
        ledger_part_->progress = config_.wall_now();
        ledger_part_->step = first_step;
        if (all_restored && restored_ns > 0) {
          ledger_part_->restored = std::min(
              ledger_part_->progress,
              ledger_part_->progress -
                  static_cast<double>(config_.monotonic_ns() - restored_ns) / 1e9);
        }
        Record(*ledger_part_);
      }
    } else if (!watching) {
      resume_began_.reset();
    }
  }
  if (now < next_metrics_update_) return;
  next_metrics_update_ = now + std::chrono::seconds(1);
  SampleProgress(sight);
  if (m == nullptr) return;
  if (sight.restarts > restarts_in_metrics_) {
    m->CountRestarts(sight.restarts - restarts_in_metrics_);
    restarts_in_metrics_ = sight.restarts;
  }
  std::vector<metrics::RankProgress> ranks;
  if (sight.board && sight.armed) {
    for (const auto& r : sight.progress()) {
      ranks.push_back({sight.rank_offset + r.local_rank, r.step, r.interval_s, r.silent_s});
    }
  }
  m->SetRankProgress(ranks);
  m->UpdateSnapshotAge(config_.wall_now());
  // The job's goodput: one node (node rank 0 of a formed round) reads the ledger every 10 s.
  if (!sight.rank0) {
    m->SetGoodput(false, 0, {});
  } else if (now >= next_goodput_) {
    next_goodput_ = now + std::chrono::seconds(10);
    if (auto report = rdzv_.ReadLedgerReport(); report.ok() && report->totals.wall_s > 0) {
      m->SetGoodput(true, report->totals.goodput(), report->totals.seconds);
    }
  }
}

}  // namespace efdl::agent
