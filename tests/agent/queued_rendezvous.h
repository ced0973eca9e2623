// A Rendezvous double the agent's tests play by hand: the test pushes the events the agent
// receives; Join returns OK or the status given to FailJoin; the agent's reports are ignored
// unless a subclass overrides them (to record them).
//
// Thread-safety: every method may be called from any thread (the agent waits for events on its
// own thread while the test pushes them).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>

#include "rendezvous/rendezvous.h"

namespace efdl::agent::testing {

class QueuedRendezvous : public rdzv::Rendezvous {
 public:
  Status Join() override {
    std::lock_guard lock(mu_);
    return join_status_;
  }
  std::optional<rdzv::Event> WaitEvent(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    rdzv::Event e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  void ReportWorkerFailure(int64_t, const std::string&) override {}
  void ReportWorkersSucceeded(int64_t) override {}
  void Leave() override {}

  void Push(rdzv::Event e) {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(e));
    cv_.notify_all();
  }
  // Join() fails with `s` from now on.
  void FailJoin(Status s) {
    std::lock_guard lock(mu_);
    join_status_ = std::move(s);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<rdzv::Event> events_;
  Status join_status_;
};

}  // namespace efdl::agent::testing
