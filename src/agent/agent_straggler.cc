// Stragglers in the agent (issue #32 part 3; docs/operations.md "Stragglers"): the Agent hands
// its StragglerWatch (straggler_watch.h) the board's progress reports about every second and
// acts on an eviction: the exclusion record, out of the job for the cool-down, workers stopped.
#include <fmt/format.h>

#include <chrono>

#include "agent/agent.h"
#include "common/log.h"

namespace efdl::agent {

void Agent::CheckStragglers() {
  const auto now = std::chrono::steady_clock::now();
  health::HangMonitor* board = hangs_.monitor();
  if (!board || !stragglers_.SampleDue(now)) return;
  if (!workers_.active() || !board->armed() || rounds_.newest.standby) return;
  if (auto eviction = stragglers_.Sample(now, rounds_.newest, board->Progress())) {
    EvictAsStraggler(*eviction);
  }
}

void Agent::EvictAsStraggler(const StragglerWatch::Eviction& eviction) {
  if (Status st = rdzv_.RecordExclusion(eviction.record); !st.ok()) {
    EFDL_LOG_WARN("{}", st.message());
  }
  // As a node that leaves on a signal does (Shutdown): out of the job first, so the others
  // re-round at once while this node's workers stop gracefully (their final snapshot); then as
  // Exclude does: no storage and no spares until the node takes part again.
  rdzv_.Withdraw(eviction.cooldown);
  StopWorkers(/*graceful=*/true, fmt::format("node {} is evicted as a straggler",
                                             options_.node_id));
  snapshots_.StopWriting();
  warm_.Clear();
  failures_.OutUntil(std::chrono::steady_clock::now() + eviction.cooldown);
}

}  // namespace efdl::agent
