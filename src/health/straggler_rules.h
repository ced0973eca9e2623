// Stragglers (issue #32, part 3): the pure rules that find a node whose ranks are persistently
// slower than the rest of the job. No clock reads, no etcd: the callers pass times and records
// (tests use fake ones).
//
// WHAT IS MEASURED. Not the step time, which synchronous data parallelism makes equal on every
// rank, but each rank's COMPUTE TIME PER STEP: from the end of its previous step's gradient
// collective to the moment its own gradients of this step were ready (data loading, forward,
// backward, optimizer step, commit: everything the rank does on its own). A straggler's compute
// time is long; its peers' is short and they wait in the collective instead.
// python/efdl/_compute.py takes the timestamps (a gradient hook per parameter and the autograd
// engine's end-of-backward callback) and adds them to the rank's progress slot as running
// totals (progress_board.h); the agent samples the totals about every second.
//
// THE RULE (docs/operations.md, "Stragglers"):
//   - each node summarises, every period P (--straggler-window / 3, longer at scale:
//     PublishPeriod), each of its ranks' compute time as the median, over the samples of the
//     last P, of the mean compute time per step within each sample (ComputeWindow);
//   - one judge (node rank 0 of the round) compares each node's slowest rank with the median
//     of the other nodes' ranks (the reference); the node is SLOW in that summary when its
//     slowest rank computes at least --straggler-factor x the reference AND at least
//     kMinExcessSeconds more per step (noise of tiny steps is not a straggler);
//   - a node slow in kWindowsToName consecutive summaries of the same round (so over about
//     --straggler-window seconds) is a STRAGGLER: named once (log line, record in etcd, metric);
//     one summary that is not slow clears it. A new round starts every node's count again.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/job_rate.h"

namespace efdl::health {

using StragglerClock = std::chrono::steady_clock;

// --straggler-factor is 0 (off) or at least this: closer to 1, noise between equal nodes is named.
inline constexpr double kMinFactor = 1.2;
// A slow node's excess per step over the reference must be at least this much.
inline constexpr double kMinExcessSeconds = 0.01;
// Consecutive slow summaries that name a straggler: --straggler-window is this many periods.
inline constexpr int kWindowsToName = 3;
// Periods are never shorter than this (the agent samples the board about once a second).
inline constexpr std::chrono::milliseconds kMinPeriod{std::chrono::seconds(2)};

struct StragglerPolicy {
  double factor = 2.0;                                             // 0: detection off
  std::chrono::milliseconds window{std::chrono::seconds(30)};      // kWindowsToName periods
  bool evict = false;                                              // --evict-stragglers
  bool enabled() const { return factor > 0; }
};

// The period of each node's summary and of the judge's reading, in a job of `nnodes` nodes:
// window / kWindowsToName, at least kMinPeriod and at least src/common/job_rate.h
// JobRatePeriod(nnodes): at scale the period grows so that the job's summaries stay below
// kJobRequestsPerSecond etcd writes per second (and the judge reads the N summaries at most once
// per period).
std::chrono::milliseconds PublishPeriod(const StragglerPolicy& policy, int nnodes);

// One node's side: its ranks' compute-time samples and their summary.
class ComputeWindow {
 public:
  // One sample of a local rank's running totals (progress_board.h: compute nanoseconds and
  // steps measured so far). The first sample of a rank (and one whose totals went back: a
  // fresh worker) only sets the baseline; later ones with new steps add a sample of the mean
  // compute time per step between the two.
  void Add(int rank, StragglerClock::time_point now, int64_t compute_ns, int64_t steps);
  // Each rank's median of its samples within [now - period, now]; ranks without one there are
  // left out.
  std::map<int, double> Summary(StragglerClock::time_point now,
                                std::chrono::milliseconds period) const;
  // Forgets everything (new workers, a new round).
  void Reset() { ranks_.clear(); }

 private:
  struct Rank {
    int64_t compute_ns = 0;
    int64_t steps = 0;
    bool baseline = false;
    std::deque<std::pair<StragglerClock::time_point, double>> samples;   // oldest first
  };
  std::map<int, Rank> ranks_;
};

// One node's published summary (rdzv::ComputeRecord carries it in etcd).
struct NodeCompute {
  std::string node;
  int64_t round = 0;
  int64_t seq = 0;                     // the node's summary number (new ones only are counted)
  std::map<int, double> compute_s;     // rank -> seconds of compute per step
};

struct Straggler {
  std::string node;
  std::vector<int> ranks;              // its ranks at or above factor x reference
  double compute_s = 0;                // its slowest rank's compute time per step
  double median_s = 0;                 // the reference: the median of the other nodes' ranks
  int windows = 0;                     // consecutive slow summaries
  double ratio() const { return median_s > 0 ? compute_s / median_s : 0; }
};

// Whether one summary of `node` is slow against the others' latest summaries (nullopt-like:
// `judged` false when there is nothing to compare with).
struct Comparison {
  bool judged = false;
  bool slow = false;
  Straggler detail;                    // windows unset
};
Comparison Compare(const StragglerPolicy& policy, const NodeCompute& node,
                   const std::vector<NodeCompute>& others);

// The judge's side: the streaks of each node over the summaries of one round.
class StragglerJudge {
 public:
  explicit StragglerJudge(StragglerPolicy policy) : policy_(policy) {}
  struct Verdict {
    std::vector<Straggler> stragglers;   // every straggler now, by node id
    std::vector<Straggler> named;        // those that became stragglers in this evaluation
    std::vector<std::string> cleared;    // nodes that were stragglers and are no longer
    bool changed() const { return !named.empty() || !cleared.empty(); }
  };
  // One evaluation over the latest summary of each node (those of other rounds are ignored).
  // A node's summary counts once (by its seq); a node without a new summary keeps its count.
  Verdict Judge(int64_t round, const std::vector<NodeCompute>& latest);
  const StragglerPolicy& policy() const { return policy_; }

 private:
  struct Track {
    int64_t seq = -1;
    int streak = 0;
    Straggler last;
  };
  StragglerPolicy policy_;
  int64_t round_ = -1;
  std::map<std::string, Track> tracks_;
  std::set<std::string> named_;
};

}  // namespace efdl::health
