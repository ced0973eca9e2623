// Waiting for a Rendezvous event in tests, shared by the rendezvous tests on the in-memory etcd
// and on a real one.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
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

}  // namespace efdl::testing
