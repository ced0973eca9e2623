// In-process round changes (docs/control-protocol.md, "In-process round changes"): workers that
// run under efdl.elastic.run said "in_process" on the control socket. At a round's close they
// are paused instead of stopped (they leave the round's process group after an agreed snapshot,
// or after a failed collective, and wait); at the next round each gets its new place as a
// "round" message and builds the new process group in the same process. Whatever cannot take
// that path - a worker that does not pause within --stop-grace (gloo cannot interrupt a
// collective waiting for a frozen peer), a changed local worker count, a standby round - falls
// back to the restart path: the workers are stopped and new ones started.
#include <algorithm>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/agent.h"
#include "common/env_names.h"
#include "common/log.h"
#include "horovod/rendezvous_server.h"

namespace efdl::agent {

bool Agent::PauseInProcess(bool graceful, const std::string& reason, std::vector<int>& unpaused) {
  unpaused.clear();
  if (options_.launcher || !group_ || group_->size() == 0) return false;
  const int64_t round = group_->round();
  const size_t n = group_->size();
  const std::vector<int> in_process = control_->InProcessRanks(round);
  if (in_process.size() != n || group_->running() != static_cast<int>(n)) return false;
  // A worker whose program returned never pauses: it is exiting (the restart path takes over).
  if (!control_->ReturnedRanks(round).empty()) return false;
  horovod_server_.reset();   // the round is over for this node
  control_->RequestPause(round, graceful, reason);
  EFDL_LOG_INFO("round {}: pausing {} worker(s) in-process ({}): {}", round, n,
                graceful ? "graceful" : "not graceful", reason);
  const auto start = std::chrono::steady_clock::now();
  auto step = std::chrono::milliseconds(1);
  while (true) {
    const std::vector<int> paused = control_->PausedRanks(round);
    const std::set<int> done(paused.begin(), paused.end());
    if (done.size() >= n) break;
    if (group_->Poll() != WorkerGroup::State::kRunning) {
      EFDL_LOG_WARN("round {}: a worker exited while pausing; this node's workers are restarted",
                    round);
      return false;
    }
    if (std::chrono::steady_clock::now() - start >= options_.stop_grace) {
      for (int lr = 0; lr < static_cast<int>(n); ++lr) {
        if (done.count(lr) == 0) unpaused.push_back(lr);
      }
      EFDL_LOG_WARN("round {}: local rank(s) {} did not pause within {} ms (a collective waiting "
                    "for a frozen or cut-off peer cannot be interrupted); this node's workers "
                    "are restarted", round, fmt::join(unpaused, ", "),
                    options_.stop_grace.count());
      return false;
    }
    if (PendingSignal() != 0) return false;   // the loop shuts down next
    std::this_thread::sleep_for(step);
    step = std::min(step * 2, std::chrono::milliseconds(10));
  }
  EFDL_LOG_INFO("round {}: {} worker(s) paused; they continue in the next round", round, n);
  group_paused_ = true;
  return true;
}

bool Agent::ContinueInProcess(const rdzv::Assignment& a, int restart_count) {
  if (!group_paused_) return false;
  const int64_t old_round = group_->round();
  const auto n = static_cast<int>(group_->size());
  std::string why;
  if (a.nproc != n) {
    why = fmt::format("this node runs {} worker(s) now, {} before", a.nproc, n);
  } else if (group_->Poll() != WorkerGroup::State::kRunning) {
    why = "a paused worker exited";
  } else if (static_cast<int>(control_->InProcessRanks(old_round).size()) != n) {
    why = "a paused worker closed its control connection";
  }
  std::vector<int> ranks;
  std::vector<std::string> log_paths;   // --log-dir: the output goes to the new round's files
  for (int lr = 0; lr < n; ++lr) {
    ranks.push_back(a.rank_offset + lr);
    log_paths.push_back(WorkerLogPath(a.round, a.rank_offset + lr));
  }
  if (why.empty()) {
    group_->Renumber(a.round, ranks, log_paths);
    for (int lr = 0; lr < n && why.empty(); ++lr) {
      const auto env = WorkerEnvironment(options_, a, lr, restart_count, socket_path_,
                                         snapshots_.holder());
      if (!control_->AssignRound(old_round, lr, a.round, a.rank_offset + lr, env)) {
        why = fmt::format("local rank {} could not be reached", lr);
      }
    }
  }
  if (!why.empty()) {
    EFDL_LOG_INFO("round {}: the paused workers cannot continue ({}): starting new ones", a.round,
                  why);
    StopWorkers(/*graceful=*/true, fmt::format("round {}: {}", a.round, why));
    return false;
  }
  group_paused_ = false;
  EFDL_LOG_INFO("round {}: node rank {} of {}, ranks {}..{} of world {}, master {}:{}; {} "
                "worker(s) continue in-process", a.round, a.node_rank, a.nnodes, a.rank_offset,
                a.rank_offset + n - 1, a.world_size, a.master_addr, a.master_port, n);
  StartHorovodRendezvous(a);
  return true;
}

void Agent::ServeInProcessFailures() {
  for (const InProcessFailure& f : control_->TakeInProcessFailures()) {
    // A report of an older round, or of one whose close already paused the workers, is news
    // the rendezvous already has.
    if (!group_ || group_paused_ || f.round != group_->round()) continue;
    if (f.own) {
      // The program raised on this rank (efdl.elastic.run said so before the process tears
      // down, which may take longer than the round's close waits for it): this node's failure,
      // whatever a lost collective of a rank beside it reported first.
      if (pending_failure_ && pending_failure_->collateral.empty()) continue;
      const std::string detail = fmt::format("rank {} raised {}", f.rank, f.message);
      EFDL_LOG_WARN("round {}: {}; this node's failure", f.round, detail);
      pending_failure_ = PendingFailure{f.round, assignment_.nnodes, detail, std::nullopt, {}, {}};
      ReportOwnFailure(f.round, detail);
      continue;
    }
    if (pending_failure_) continue;
    // A rank of this node that returned while the others trained broke their collective: this
    // node's failure (an exit, usually reaped before the collective's error reached us).
    group_->Poll();
    if (const auto early = EarlyExit0(); early && !group_->first_failure()) {
      BlameEarlyExit0(f.round, *early);
      continue;
    }
    const std::string detail = fmt::format("rank {}: a collective failed ({})", f.rank,
                                           f.message);
    // Under efdl.elastic.run the worker itself is alive: its collective failed because a peer
    // went away, hung or raised - that peer's node counts the failure, not this one.
    EFDL_LOG_WARN("round {}: {}; the round is formed again, the workers wait in-process",
                  f.round, detail);
    pending_failure_ = PendingFailure{f.round, assignment_.nnodes, detail, std::nullopt, {}, {}};
    const bool stalled = hangs_.Stalled();
    pending_failure_->collateral = stalled ? CollateralCause(true, {})
                                           : "a collective that lost a peer (its node counts it)";
    rdzv_.ReportLostPeer(f.round, detail, pending_failure_->collateral);
  }
}

}  // namespace efdl::agent
