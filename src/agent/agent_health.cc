// Hang detection in the agent (issue #32; src/health; docs/operations.md "Hangs"): the workers
// report progress on the progress board; a rank silent for its timeout makes the HangWatch
// (hang_watch.h) write every local worker's Python stack, and this agent ends the workers of the
// node that caused it. Also: which failures of this node are collateral (CollateralCause).

#include <fmt/format.h>

#include <filesystem>

#include "agent/agent.h"
#include "common/log.h"

namespace efdl::agent {

std::string Agent::CollateralCause(bool stalled, const std::vector<std::string>& tail) const {
  if (stalled) return "a hang whose cause was on another node";
  // A collective that lost its peer (the peer crashed, raised, exited or was ended): gloo's
  // "Connection closed by peer" / "Connection reset by peer", a broken pipe, NCCL's remote
  // error. The peer's own node counts that failure.
  static constexpr std::string_view kPeerLost[] = {
      "Connection closed by peer", "Connection reset by peer", "Broken pipe",
      "NCCL error: remote process exited", "remote process exited or there was a network error"};
  // Only the error the worker died of: its last traceback (a worker under efdl.elastic.run
  // outlives rounds whose collectives lost a peer, and their lines stay in its tail when its
  // own code raises later).
  size_t from = 0;
  for (size_t i = 0; i < tail.size(); ++i) {
    if (tail[i].find("Traceback (most recent call last)") != std::string::npos) from = i;
  }
  for (const auto& line : std::vector<std::string>(tail.begin() + from, tail.end())) {
    for (auto mark : kPeerLost) {
      if (line.find(mark) != std::string::npos) {
        return fmt::format("a collective that lost a peer ({})", mark);
      }
    }
  }
  return "";
}

void Agent::StartHangMonitor() {
  if (!HangDetectionOn(options_)) return;
  hangs_.Start(std::filesystem::path(workers_.socket_path()).parent_path().string());
}

void Agent::ArmHangMonitor(bool fresh) {
  WorkerGroup* group = workers_.group();
  hangs_.Arm(group ? group->pids() : std::vector<pid_t>{}, fresh);
}

void Agent::CheckHang() {
  if (!hangs_.monitor() || !workers_.active() || failures_.pending()) return;
  WorkerGroup* group = workers_.group();
  const int64_t round = group->round();
  const HangWatch::Verdict v =
      hangs_.Check(std::chrono::steady_clock::now(), round, rounds_.newest.rank_offset,
                   [group] { return group->Poll() == WorkerGroup::State::kRunning; });
  switch (v.kind) {
    case HangWatch::Verdict::Kind::kNone:
      return;
    case HangWatch::Verdict::Kind::kOwn:
      EndHungWorkers(round, v.detail);
      return;
    case HangWatch::Verdict::Kind::kNoCause:
      group->Close();
      StopWorkers(/*graceful=*/false, v.detail);
      // Counted against nobody.
      RecordFailure(round, rounds_.newest.nnodes, v.detail, "a hang whose cause no node found");
      rdzv_.ReportLostPeer(round, v.detail, failures_.pending()->collateral);
      return;
  }
}

void Agent::EndHungWorkers(int64_t round, const std::string& detail) {
  EFDL_LOG_ERROR("job {} round {}: {}: the hang is this node's ({}); ending its workers",
                 options_.job_id, round, detail, options_.node_id);
  workers_.group()->Close();   // SIGKILL: a stopped or stuck process answers nothing else
  StopWorkers(/*graceful=*/false, detail);
  RecordFailure(round, rounds_.newest.nnodes, detail);
  ReportOwnFailure(round, detail);
}

}  // namespace efdl::agent
