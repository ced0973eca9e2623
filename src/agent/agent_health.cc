// Hang detection in the agent (issue #32; src/health; docs/operations.md "Hangs"): the workers
// report progress on the progress board; a rank silent for its timeout makes this agent write
// every local worker's Python stack and end the workers of the node that caused it.
#include <signal.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <sstream>

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
  const std::string dir = std::filesystem::path(socket_path_).parent_path().string();
  auto monitor =
      health::HangMonitor::Create(dir, options_.nproc, {options_.hang_timeout_s});
  if (!monitor.ok()) {
    EFDL_LOG_WARN("hang detection is off on this node: {}", monitor.status().message());
    return;
  }
  hang_ = std::move(monitor).value();
}

void Agent::ArmHangMonitor(bool fresh) {
  hang_elsewhere_ = false;
  hang_fallback_at_.reset();
  hang_confirm_.reset();
  if (!hang_ || !group_) return;
  hang_->Arm(group_->pids(), fresh);
}

void Agent::CheckHang() {
  if (!hang_ || !group_ || group_paused_ || pending_failure_) return;
  const auto now = std::chrono::steady_clock::now();
  const int64_t round = group_->round();
  if (hang_fallback_at_) {   // (the monitor is disarmed while this node waits for the culprit's)
    if (now < *hang_fallback_at_) return;
    hang_fallback_at_.reset();
    const std::string detail = fmt::format(
        "no rank of any node made progress for another {:.0f} s and no node found the cause",
        hang_->running_timeout_s());
    EFDL_LOG_ERROR("job {} round {}: {}: ending this node's workers so that the job forms again",
                   options_.job_id, round, detail);
    hang_->Disarm();
    group_->Close();
    StopWorkers(/*graceful=*/false, detail);
    pending_failure_ = PendingFailure{round, assignment_.nnodes, detail, std::nullopt, {}, {}};
    pending_failure_->collateral = "a hang whose cause no node found";   // counted against nobody
    rdzv_.ReportLostPeer(round, detail, pending_failure_->collateral);
    return;
  }
  if (hang_confirm_) {
    if (now < hang_confirm_->at) return;
    const HangConfirm c = *std::exchange(hang_confirm_, std::nullopt);
    hang_elsewhere_ = false;
    // Still there and not exiting: its own code holds it (a worker whose collective broke
    // because another node just ended its culprit would have failed by now, and PollWorkers
    // would have taken that failure before this).
    if (::kill(c.pid, 0) != 0 || group_->Poll() != WorkerGroup::State::kRunning) return;
    EndHungWorkers(round, c.detail);
    return;
  }
  if (!hang_->armed()) return;
  const std::vector<health::HungRank> hung = hang_->Check();
  if (hung.empty()) return;
  std::vector<std::string> names;
  for (const auto& h : hung) {
    names.push_back(fmt::format("rank {}{}", assignment_.rank_offset + h.local_rank,
                                h.step >= 0 ? fmt::format(" (last step {})", h.step) : ""));
  }
  EFDL_LOG_ERROR("job {} round {}: {} on node {} made no progress for {:.1f} s (hang timeout "
                 "{:.0f} s); writing every local worker's Python stack",
                 options_.job_id, round, fmt::join(names, ", "), options_.node_id,
                 hung.front().silent_s, hung.front().limit_s);
  const std::vector<health::StackReport> stacks =
      hang_->DumpStacks(std::chrono::milliseconds(1000));
  std::vector<const health::StackReport*> culprits;
  for (const auto& s : stacks) {
    const int rank = assignment_.rank_offset + s.local_rank;
    EFDL_LOG_WARN("round {}: rank {} (pid {}) is {}{}", round, rank, s.pid, s.why,
                  s.stack.empty() ? "" : "; its Python stack:");
    std::istringstream lines(s.stack);
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty()) EFDL_LOG_WARN("  [rank {}] {}", rank, line);
    }
    if (s.culprit) culprits.push_back(&s);
  }
  // The pause began at the last progress; its detection took the silence until now.
  observer_.HangDeclared(now, hung.front().silent_s, /*own=*/!culprits.empty(), Sight());
  hang_->Disarm();
  if (culprits.empty()) {
    hang_elsewhere_ = true;
    hang_fallback_at_ = now + std::chrono::milliseconds(
                                  static_cast<int64_t>(hang_->running_timeout_s() * 1000));
    EFDL_LOG_WARN("round {}: this node's ranks wait in collectives for a peer: the hang's cause "
                  "is on another node, which ends its workers; if no progress comes within "
                  "{:.0f} s, this node ends its workers too",
                  round, hang_->running_timeout_s());
    return;
  }
  const health::StackReport& c = *culprits.front();
  const std::string detail = fmt::format("rank {} made no progress for {:.0f} s ({})",
                                         assignment_.rank_offset + c.local_rank,
                                         hung.front().silent_s, c.why);
  if (c.state == 'T' || c.state == 't' || c.state == 'D') {
    EndHungWorkers(round, detail);   // stopped or stuck in the kernel: nothing else can be
    return;
  }
  // Outside a collective in one sample: every node's monitor fires at about the same moment, so
  // this rank may just be failing because another node ended its culprit (a collective error
  // being raised). Confirm after kHangConfirm that it is still alive and running; until then a
  // failure of these workers is collateral.
  hang_elsewhere_ = true;
  hang_confirm_ = HangConfirm{now + kHangConfirm, c.pid, detail};
}

void Agent::EndHungWorkers(int64_t round, const std::string& detail) {
  EFDL_LOG_ERROR("job {} round {}: {}: the hang is this node's ({}); ending its workers",
                 options_.job_id, round, detail, options_.node_id);
  group_->Close();   // SIGKILL: a stopped or stuck process answers nothing else
  StopWorkers(/*graceful=*/false, detail);
  pending_failure_ = PendingFailure{round, assignment_.nnodes, detail, std::nullopt, {}, {}};
  ReportOwnFailure(round, detail);
}

}  // namespace efdl::agent
