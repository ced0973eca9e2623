// What the agent observes of its node for others to read (issue #33): its metrics and its part
// of the goodput ledger are NodeObserver's (node_observer.h); the Agent tells it what happens and
// shows it the round's workers.
#include <chrono>

#include "agent/agent.h"

namespace efdl::agent {

NodeObserver::Sight Agent::Sight() const {
  NodeObserver::Sight s;
  if (health::HangMonitor* board = hangs_.monitor()) {
    s.board = true;
    s.armed = workers_.group() && board->armed();
    s.progress = [board] { return board->Progress(); };
    s.uncommitted = [board] { return board->Uncommitted(); };
  }
  s.paused = workers_.paused();
  s.rank_offset = rounds_.newest.rank_offset;
  s.rank0 = workers_.group() && !rounds_.newest.standby && rounds_.newest.node_rank == 0;
  s.restarts = failures_.restarts();
  return s;
}

void Agent::BeginPause(std::chrono::steady_clock::time_point at) {
  observer_.BeginPause(at, Sight());
}

}  // namespace efdl::agent
