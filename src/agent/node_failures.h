// NodeFailures: how this node's worker failures count (issue #32, "Nodes that keep failing";
// issue #31 step 1; docs/operations.md). It holds the node's own failures (the exclusion rule's
// sliding window, src/health/exclusion_rules.h), the streak of collateral failures that are not
// counted until it grows too long, and the end of the node's exclusion while it is out of the
// job.
//
// It only counts: the Agent decides which failure is collateral (blame), logs, and acts on a
// verdict (restart, exclude, give up). It holds the failure the Agent recorded in a round until
// the next round counts it (pending()).
//
// Single-threaded: called from the Agent's loop. Times are passed in (tests use fake ones).
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/worker_group.h"
#include "health/exclusion_rules.h"
#include "rendezvous/rendezvous.h"

namespace efdl::agent {

// A failure of this node's workers in a round, counted (or not) when the next round starts.
struct PendingFailure {
  int64_t round = 0;
  int nnodes = 0;
  std::string detail;                               // "rank N exited with status 1", ...
  std::optional<PeerConnectError> connect_error;   // a worker's line about a peer, if any
  std::vector<std::string> stderr_tail;             // the failing rank's last stderr lines
  // Not this node's failure (issue #32, blame): why - another node's rank hung and was ended
  // there, or a collective lost a peer that crashed, raised or exited. Logged, not counted.
  // Empty: this node's own failure.
  std::string collateral;
};

class NodeFailures {
 public:
  using Clock = std::chrono::steady_clock;
  // Collateral failures in a row (each within kStreakReset of its round's start, with no change
  // of the job's node count between them) that are not counted; from the next one on they are
  // (at least 2x --max-restarts).
  static constexpr int kCollateralStreak = 6;
  static constexpr std::chrono::seconds kStreakReset{60};

  // `min_nodes`: the job's --nnodes MIN (whether it can go on without this node).
  NodeFailures(health::ExclusionPolicy policy, int min_nodes)
      : own_(policy), min_nodes_(min_nodes) {}

  // A round of `nnodes` nodes reached this node as a member: a change of the job's node count
  // ends a streak of collateral failures (the node whose failures they were may be the one that
  // left or joined).
  void RoundFormed(int nnodes);
  // A collateral failure at `now` of a round whose workers started at `round_started`: true
  // when it counts as this node's all the same (the streak grew too long; see streak()).
  bool CollateralCounts(Clock::time_point now, Clock::time_point round_started);
  // A failure of this node's own: the collateral streak ends.
  void EndStreak() { streak_ = 0; }
  // The collateral failures in a row so far.
  int streak() const { return streak_; }
  // The job can go on without this node in round `next` (it holds MIN other nodes; a
  // standby's round holds only others): then it is excluded for a while instead of giving up.
  bool CanExclude(const rdzv::Assignment& next) const {
    const int others = next.standby ? next.nnodes : next.nnodes - 1;
    return others >= std::max(1, min_nodes_);
  }
  // One failure counted against this node at `now`: the exclusion rule's verdict.
  health::FailureVerdict Count(Clock::time_point now, bool can_exclude) {
    return own_.Count(now, can_exclude);
  }
  // The verdict Count would give now, without counting (asked ahead of the next round).
  health::FailureVerdict CountAhead(Clock::time_point now, bool can_exclude) const {
    health::OwnFailures ahead = own_;
    return ahead.Count(now, can_exclude);
  }
  // This node's own failures counted so far (RESTARTS in `efdl status`), its exclusions.
  int restarts() const { return own_.total(); }
  int exclusions() const { return own_.exclusions(); }
  const health::ExclusionPolicy& policy() const { return own_.policy(); }

  // Out of the job (excluded, evicted as a straggler) until `until`.
  void OutUntil(Clock::time_point until) { out_until_ = until; }
  // Excluded (an end is set: until CheckOut says kBack).
  bool out() const { return out_until_.has_value(); }
  enum class Out {
    kNo,     // not excluded
    kStill,  // excluded: no round is expected before the cool-down ends
    kBack,   // the cool-down is over (said once; kNo from then on)
  };
  Out CheckOut(Clock::time_point now);

  // The failure recorded in the round that closes, if any, until the next round counts it.
  std::optional<PendingFailure>& pending() { return pending_; }
  const std::optional<PendingFailure>& pending() const { return pending_; }
  // True the first time only: a peer-connect error is explained once per agent (the next
  // rounds would only repeat it).
  bool FirstConnectErrorExplanation() { return !std::exchange(connect_error_explained_, true); }

 private:
  // 7 members: the own failures, MIN, the collateral streak and its node count, the exclusion,
  // the pending failure, whether a connect error was explained.
  health::OwnFailures own_;
  const int min_nodes_;
  int streak_ = 0;
  int streak_nnodes_ = 0;   // the node count of the rounds of the current streak
  std::optional<Clock::time_point> out_until_;
  std::optional<PendingFailure> pending_;
  bool connect_error_explained_ = false;
};

}  // namespace efdl::agent
