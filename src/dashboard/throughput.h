// Training throughput from the ranks' step counters (efdl_rank_step), read once per poll: each
// rank's steps per second over a short sliding window, and the job's, kept as a bounded
// timeline for the dashboard's chart. Pure: the caller passes the wall time of every reading.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace efdl::dashboard {

struct StepReading {
  std::string node;
  int rank = 0;
  int64_t step = 0;
};

struct ThroughputPoint {
  double t = 0;                  // wall seconds since the epoch
  double rank_steps_per_s = 0;   // the sum over the ranks read (samples/s = this x batch per rank)
  double job_steps_per_s = 0;    // the median rank's rate: the job's step rate (data parallel)
  int ranks = 0;                 // ranks read at t
  int64_t round = 0;
  int world_size = 0;
};

class ThroughputHistory {
 public:
  // rate_window_s: a rank's rate is its step progress over (about) this long; window_s and
  // max_points bound the timeline.
  explicit ThroughputHistory(double rate_window_s = 5, double window_s = 1800,
                             size_t max_points = 4000)
      : rate_window_s_(rate_window_s), window_s_(window_s), max_points_(max_points) {}

  // One poll at wall time `now`: the steps read from every reachable node. A rank read for the
  // first time, or whose step went back (the job resumed from an earlier snapshot and trains
  // those steps again), has rate 0 until its next reading. Ranks not read are forgotten.
  void Observe(double now, const std::vector<StepReading>& readings, int64_t round,
               int world_size);

  // The rank's latest rate (steps/s), if it was read at the last poll.
  std::optional<double> RankRate(const std::string& node, int rank) const;
  const std::deque<ThroughputPoint>& points() const { return points_; }

 private:
  struct RankTrack {
    std::deque<std::pair<double, int64_t>> readings;   // (t, step), newest last
    double rate = 0;
  };
  double rate_window_s_;
  double window_s_;
  size_t max_points_;
  std::map<std::pair<std::string, int>, RankTrack> ranks_;
  std::deque<ThroughputPoint> points_;
};

}  // namespace efdl::dashboard
