// Nodes that keep failing (issue #32, part 4): the pure rule that decides, for each failure of
// a node's own workers, whether the node restarts them, is excluded from the job's rounds for a
// cool-down, or gives up for good. No clock reads: the caller passes the time (tests use a fake
// clock). The agent (src/agent/agent.cc CountPendingFailure) feeds it the failures it did not
// find collateral (caused by another node: those never reach this rule).
//
// THE RULE (docs/operations.md, "Nodes that keep failing"):
//   - exclusion: the K-th own failure within the window (--exclude-after K, --exclude-window W)
//     excludes the node for the cool-down (--exclude-cooldown C), when the job can go on without
//     it (the round has at least MIN other nodes). The cool-down doubles with each exclusion of
//     the same agent, up to kMaxCooldownFactor x C (Horovod's blacklist with its back-off). The
//     window starts empty again after an exclusion: the node comes back with a clean slate.
//   - giving up (today's rule, kept where exclusion cannot help): with --exclude-after 0, or when
//     the job cannot go on without the node, the node gives up for good once its own failures
//     over the agent's life exceed --max-restarts.
#pragma once

#include <chrono>
#include <deque>

namespace efdl::health {

using FailureClock = std::chrono::steady_clock;

struct ExclusionPolicy {
  int after = 3;                                            // K; 0: never excluded
  std::chrono::milliseconds window{std::chrono::seconds(600)};
  std::chrono::milliseconds cooldown{std::chrono::seconds(300)};
  int max_restarts = 3;                                     // the give-up bound (see above)
  bool enabled() const { return after > 0; }
};

// The cool-down doubles with each exclusion, up to this factor of --exclude-cooldown.
inline constexpr int kMaxCooldownFactor = 8;

// The cool-down of the `exclusion`-th exclusion (1: the first).
std::chrono::milliseconds CooldownFor(const ExclusionPolicy& policy, int exclusion);

struct FailureVerdict {
  enum class Action { kRestart, kExclude, kGiveUp };
  Action action = Action::kRestart;
  int in_window = 0;    // own failures within the window, this one included
  int total = 0;        // own failures over the agent's life, this one included (RESTARTS)
  int exclusion = 0;    // kExclude: this exclusion's number (1: the first)
  std::chrono::milliseconds cooldown{0};     // kExclude
  FailureClock::time_point until{};          // kExclude: when the node may rejoin
};

// One agent's own failures.
class OwnFailures {
 public:
  explicit OwnFailures(ExclusionPolicy policy) : policy_(policy) {}
  // One own failure at `now`. `can_exclude`: the job can go on without this node.
  FailureVerdict Count(FailureClock::time_point now, bool can_exclude);
  // Own failures within the window that ends at `now`.
  int InWindow(FailureClock::time_point now) const;
  int total() const { return total_; }
  int exclusions() const { return exclusions_; }
  const ExclusionPolicy& policy() const { return policy_; }

 private:
  void Expire(FailureClock::time_point now);

  ExclusionPolicy policy_;
  std::deque<FailureClock::time_point> recent_;   // within the window, oldest first
  int total_ = 0;
  int exclusions_ = 0;
};

}  // namespace efdl::health
