// HangWatch (hang_watch.h): the hang's judgement on this node, its stacks and what to do.
#include "agent/hang_watch.h"

#include <signal.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>

#include "common/log.h"

namespace efdl::agent {

void HangWatch::Start(const std::string& dir) {
  auto monitor = health::HangMonitor::Create(dir, config_.nproc, {config_.hang_timeout_s});
  if (!monitor.ok()) {
    EFDL_LOG_WARN("hang detection is off on this node: {}", monitor.status().message());
    return;
  }
  monitor_ = std::move(monitor).value();
}

void HangWatch::Arm(const std::vector<pid_t>& pids, bool fresh) {
  elsewhere_ = false;
  fallback_at_.reset();
  confirm_.reset();
  if (!monitor_ || pids.empty()) return;
  monitor_->Arm(pids, fresh);
}

void HangWatch::Disarm() {
  if (monitor_) monitor_->Disarm();
}

bool HangWatch::Stalled() {
  return elsewhere_ || (monitor_ && monitor_->Stalled(kCollateralStall));
}

HangWatch::Verdict HangWatch::Check(Clock::time_point now, int64_t round, int rank_offset,
                                    const std::function<bool()>& running) {
  using Kind = Verdict::Kind;
  if (!monitor_) return {};
  if (fallback_at_) {   // (the monitor is disarmed while this node waits for the culprit's)
    if (now < *fallback_at_) return {};
    fallback_at_.reset();
    const std::string detail = fmt::format(
        "no rank of any node made progress for another {:.0f} s and no node found the cause",
        monitor_->running_timeout_s());
    EFDL_LOG_ERROR("job {} round {}: {}: ending this node's workers so that the job forms again",
                   config_.job_id, round, detail);
    monitor_->Disarm();
    return {Kind::kNoCause, detail};
  }
  if (confirm_) {
    if (now < confirm_->at) return {};
    const Confirm c = *std::exchange(confirm_, std::nullopt);
    elsewhere_ = false;
    // Still there and not exiting: its own code holds it (a worker whose collective broke
    // because another node just ended its culprit would have failed by now, and the Agent
    // would have taken that failure before this).
    if (::kill(c.pid, 0) != 0 || !running()) return {};
    return {Kind::kOwn, c.detail};
  }
  if (!monitor_->armed()) return {};
  const std::vector<health::HungRank> hung = monitor_->Check();
  if (hung.empty()) return {};
  std::vector<std::string> names;
  for (const auto& h : hung) {
    names.push_back(fmt::format("rank {}{}", rank_offset + h.local_rank,
                                h.step >= 0 ? fmt::format(" (last step {})", h.step) : ""));
  }
  EFDL_LOG_ERROR("job {} round {}: {} on node {} made no progress for {:.1f} s (hang timeout "
                 "{:.0f} s); writing every local worker's Python stack",
                 config_.job_id, round, fmt::join(names, ", "), config_.node_id,
                 hung.front().silent_s, hung.front().limit_s);
  const std::vector<health::StackReport> stacks =
      monitor_->DumpStacks(std::chrono::milliseconds(1000));
  std::vector<const health::StackReport*> culprits;
  for (const auto& s : stacks) {
    const int rank = rank_offset + s.local_rank;
    EFDL_LOG_WARN("round {}: rank {} (pid {}) is {}{}", round, rank, s.pid, s.why,
                  s.stack.empty() ? "" : "; its Python stack:");
    std::istringstream lines(s.stack);
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty()) EFDL_LOG_WARN("  [rank {}] {}", rank, line);
    }
    if (s.culprit) culprits.push_back(&s);
  }
  // The pause began at the last progress; its detection took the silence until now.
  if (config_.on_declared) config_.on_declared(now, hung.front().silent_s, !culprits.empty());
  monitor_->Disarm();
  if (culprits.empty()) {
    elsewhere_ = true;
    fallback_at_ = now + std::chrono::milliseconds(
                             static_cast<int64_t>(monitor_->running_timeout_s() * 1000));
    EFDL_LOG_WARN("round {}: this node's ranks wait in collectives for a peer: the hang's cause "
                  "is on another node, which ends its workers; if no progress comes within "
                  "{:.0f} s, this node ends its workers too",
                  round, monitor_->running_timeout_s());
    return {};
  }
  const health::StackReport& c = *culprits.front();
  const std::string detail = fmt::format("rank {} made no progress for {:.0f} s ({})",
                                         rank_offset + c.local_rank, hung.front().silent_s,
                                         c.why);
  if (c.state == 'T' || c.state == 't' || c.state == 'D') {
    return {Kind::kOwn, detail};   // stopped or stuck in the kernel: nothing else can be
  }
  // Outside a collective in one sample: every node's monitor fires at about the same moment, so
  // this rank may just be failing because another node ended its culprit (a collective error
  // being raised). Confirm after kConfirm that it is still alive and running; until then a
  // failure of these workers is collateral.
  elsewhere_ = true;
  confirm_ = Confirm{now + kConfirm, c.pid, detail};
  return {};
}

}  // namespace efdl::agent
