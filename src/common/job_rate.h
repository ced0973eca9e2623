// The job-wide request rate (issue #37): something each of a job's N nodes does once per period
// (read or write O(N) in etcd) stays below kJobRequestsPerSecond requests per second for the
// whole job, at any N, when the period is at least JobRatePeriod(N) = N / kJobRequestsPerSecond
// seconds. Its users add their own floor: src/rendezvous/node_books.h CountGap (the counts of the
// job's nodes), src/health/straggler_rules.h PublishPeriod (the straggler summaries and the
// judge's reads).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace efdl {

inline constexpr int64_t kJobRequestsPerSecond = 100;

// The shortest period at which each of `nodes` nodes may send one such request (0 for none).
inline constexpr std::chrono::milliseconds JobRatePeriod(int64_t nodes) {
  return std::chrono::milliseconds(std::max<int64_t>(nodes, 0) * 1000 / kJobRequestsPerSecond);
}

}  // namespace efdl
