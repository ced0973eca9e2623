// The part of the Prometheus text exposition format (version 0.0.4) the dashboard reads from
// the agents' /metrics endpoints (src/metrics/agent_metrics.h): sample lines with labels. The
// agents' exposition is prometheus-cpp's; this is only its reader, for `efdl dashboard`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/status.h"

namespace efdl::dashboard {

struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Every sample line of `text`; comment (# HELP, # TYPE) and blank lines are skipped, a
// trailing timestamp is ignored. Label values are unescaped (\\, \", \n). Values may be NaN,
// +Inf, -Inf. A malformed line is an error naming its line number.
Result<std::vector<MetricSample>> ParseMetricsText(std::string_view text);

// What the dashboard takes from one node's metrics.
struct RankStep {
  int rank = 0;
  int64_t step = 0;
};
struct NodeMetrics {
  std::vector<RankStep> ranks;   // efdl_rank_step{rank} with a known step (>= 0), by rank
  int64_t round = -1;            // efdl_round (-1: absent)
  int world_size = -1;           // efdl_world_size (-1: absent)
};
NodeMetrics ExtractNodeMetrics(const std::vector<MetricSample>& samples);

}  // namespace efdl::dashboard
