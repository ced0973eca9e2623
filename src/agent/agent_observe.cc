// The agent's side of its node's metrics (src/metrics/agent_metrics.h, issue #33): what the loop
// reports on each turn, and when a round change's pause began.
#include <chrono>
#include <vector>

#include "agent/agent.h"

namespace efdl::agent {

void Agent::BeginPause(std::chrono::steady_clock::time_point at) {
  if (!pause_began_ || at < *pause_began_) pause_began_ = at;
}

void Agent::UpdateMetrics() {
  metrics::AgentMetrics* m = options_.metrics;
  if (m == nullptr) return;
  const auto now = std::chrono::steady_clock::now();
  // The resume phase: from the new round's start until every local rank reported progress
  // (checked on each turn: it is a few reads of shared memory). Without a progress board (hang
  // detection off, --launcher) it cannot be seen and is not reported.
  if (resume_began_) {
    const bool watching = hang_ && group_ && !group_paused_ && hang_->armed();
    bool all = watching;
    if (watching) {
      for (const auto& r : hang_->Progress()) all = all && r.progressed;
    }
    if (all) {
      m->ObservePause(resume_phase_,
                      std::chrono::duration<double>(now - *resume_began_).count());
      resume_began_.reset();
    } else if (!watching) {
      resume_began_.reset();
    }
  }
  if (now < next_metrics_update_) return;
  next_metrics_update_ = now + std::chrono::seconds(1);
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
  m->UpdateSnapshotAge(std::chrono::duration<double>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count());
}

}  // namespace efdl::agent
