// Waiting for a Rendezvous event in tests, shared by the rendezvous tests on the in-memory etcd
// and on a real one.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/rendezvous.h"

namespace efdl::testing {

// The next event of `type` within `timeout`; events of other types on the way are dropped, or
// appended to `*seen` when it is given (so a test can check what came before). nullopt when none
// came in time.
inline std::optional<rdzv::Event> NextEvent(rdzv::Rendezvous& r, rdzv::Event::Type type,
                                            std::chrono::milliseconds timeout,
                                            std::vector<rdzv::Event>* seen = nullptr) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    auto e = r.WaitEvent(std::max(left, std::chrono::milliseconds(1)));
    if (!e) break;  // WaitEvent waited out the rest of the deadline
    if (seen != nullptr) seen->push_back(*e);
    if (e->type == type) return e;
  }
  return std::nullopt;
}

// Options for node `node` of job `job` (MIN:MAX = min:max) with the fast timing of the tests on
// the in-memory etcd: rounds form in well under a second, a lease outlives any test.
inline rdzv::RendezvousOptions FastRendezvousOptions(const std::string& job,
                                                     const std::string& node, int min, int max) {
  using namespace std::chrono_literals;
  rdzv::RendezvousOptions o;
  o.job_id = job;
  o.node_id = node;
  o.advertise_addr = "127.0.0.1";
  o.min_nodes = min;
  o.max_nodes = max;
  o.ttl = 10s;
  o.last_call = 300ms;
  o.join_timeout = 20s;
  o.liveness_window = 200ms;
  o.takeover_step = 100ms;
  return o;
}

}  // namespace efdl::testing
