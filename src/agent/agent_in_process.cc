// In-process round changes (docs/control-protocol.md, "In-process round changes"): workers that
// run under efdl.elastic.run said "in_process" on the control socket. At a round's close they
// are paused instead of stopped (they leave the round's process group after an agreed snapshot,
// or after a failed collective, and wait); at the next round each gets its new place as a
// "round" message and builds the new process group in the same process. Whatever cannot take
// that path - a worker that does not pause within --stop-grace (gloo cannot interrupt a
// collective waiting for a frozen peer), a changed local worker count, a standby round - falls
// back to the restart path: the workers are stopped and new ones started.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/agent.h"
#include "common/log.h"

namespace efdl::agent {

bool Agent::ContinueInProcess(const rdzv::Assignment& a, int restart_count) {
  std::vector<std::string> log_paths;   // --log-dir: the output goes to the new round's files
  for (int lr = 0; lr < a.nproc; ++lr) {
    log_paths.push_back(WorkerLogPath(a.round, a.rank_offset + lr));
  }
  const std::string why = workers_.Continue(
      a,
      [&](int lr) {
        return WorkerEnvironment(options_, a, lr, restart_count, workers_.socket_path(),
                                 snapshots_.holder());
      },
      log_paths);
  if (!why.empty()) {
    EFDL_LOG_INFO("round {}: the paused workers cannot continue ({}): starting new ones", a.round,
                  why);
    StopWorkers(/*graceful=*/true, fmt::format("round {}: {}", a.round, why));
    return false;
  }
  const int n = a.nproc;
  EFDL_LOG_INFO("round {}: node rank {} of {}, ranks {}..{} of world {}, master {}:{}; {} "
                "worker(s) continue in-process", a.round, a.node_rank, a.nnodes, a.rank_offset,
                a.rank_offset + n - 1, a.world_size, a.master_addr, a.master_port, n);
  workers_.StartHorovodRendezvous(a);
  return true;
}

void Agent::ServeInProcessFailures() {
  for (const InProcessFailure& f : workers_.channel().TakeInProcessFailures()) {
    // A report of an older round, or of one whose close already paused the workers, is news
    // the rendezvous already has.
    WorkerGroup* group = workers_.group();
    if (!workers_.active() || f.round != group->round()) continue;
    if (f.own) {
      // The program raised on this rank (efdl.elastic.run said so before the process tears
      // down, which may take longer than the round's close waits for it): this node's failure,
      // whatever a lost collective of a rank beside it reported first.
      if (failures_.pending() && failures_.pending()->collateral.empty()) continue;
      const std::string detail = fmt::format("rank {} raised {}", f.rank, f.message);
      EFDL_LOG_WARN("round {}: {}; this node's failure", f.round, detail);
      RecordFailure(f.round, rounds_.newest.nnodes, detail);
      ReportOwnFailure(f.round, detail);
      continue;
    }
    if (failures_.pending()) continue;
    // A rank of this node that returned while the others trained broke their collective: this
    // node's failure (an exit, usually reaped before the collective's error reached us).
    group->Poll();
    if (const auto early = workers_.EarlyExit0(rounds_.newest.rank_offset);
        early && !group->first_failure()) {
      BlameEarlyExit0(f.round, *early);
      continue;
    }
    const std::string detail = fmt::format("rank {}: a collective failed ({})", f.rank,
                                           f.message);
    // Under efdl.elastic.run the worker itself is alive: its collective failed because a peer
    // went away, hung or raised - that peer's node counts the failure, not this one.
    EFDL_LOG_WARN("round {}: {}; the round is formed again, the workers wait in-process",
                  f.round, detail);
    RecordFailure(f.round, rounds_.newest.nnodes, detail,
                  hangs_.Stalled() ? CollateralCause(true, {})
                                   : "a collective that lost a peer (its node counts it)");
    rdzv_.ReportLostPeer(f.round, detail, failures_.pending()->collateral);
  }
}

}  // namespace efdl::agent
