// A small pool of threads that drives many EtcdRendezvous state machines (issue #37): `efdl sim`
// runs 10,000 simulated nodes on a few dozen threads instead of one driver thread per node, so
// that what it measures is the protocol, not 10,000 threads competing for two cores.
//
// Each node owns a Strand: its step (the same batch of inputs, timers and coordinator step the
// node's own driver thread runs) never runs on two threads at once, runs again when it was woken
// while running, and runs at the deadline it returned last. Nothing here knows about the
// protocol: the node's code paths are exactly those of a node with its own thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"

namespace efdl::rdzv {

class DriverPool {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;
  // One step of a node; returns when it must run next without being woken (nullopt: only when
  // woken).
  using Step = std::function<std::optional<TimePoint>()>;

  class Strand;

  explicit DriverPool(int threads);
  ~DriverPool();   // stops the threads; every strand must have been closed
  DriverPool(const DriverPool&) = delete;
  DriverPool& operator=(const DriverPool&) = delete;

  std::shared_ptr<Strand> NewStrand(Step step);
  // Runs the strand's step soon (again, if it is running now). From any thread.
  void Wake(const std::shared_ptr<Strand>& strand) EFDL_EXCLUDES(mu_);
  // The step never runs again; waits until it is not running (unless called from it).
  void Close(const std::shared_ptr<Strand>& strand) EFDL_EXCLUDES(mu_);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run() EFDL_EXCLUDES(mu_);
  // Makes the strand ready; true when it went into ready_ and a waiting thread should be woken
  // for it (the caller notifies cv_, after unlocking where it can).
  bool Schedule(const std::shared_ptr<Strand>& s) EFDL_REQUIRES(mu_);

  using Timer = std::pair<TimePoint, std::shared_ptr<Strand>>;
  struct Later {
    bool operator()(const Timer& a, const Timer& b) const { return a.first > b.first; }
  };

  Mutex mu_;
  std::condition_variable_any cv_;        // work or a timer for the threads
  std::condition_variable_any idle_cv_;   // a strand stopped running (Close)
  std::deque<std::shared_ptr<Strand>> ready_ EFDL_GUARDED_BY(mu_);
  std::priority_queue<Timer, std::vector<Timer>, Later> timers_ EFDL_GUARDED_BY(mu_);
  bool stop_ EFDL_GUARDED_BY(mu_) = false;
  // Threads waiting in cv_: a wake-up goes out only when one of them can take the work (a
  // thread that is running a step finds the ready queue when it comes back). Each needless
  // notify costs a futex wake and a context switch: with 10,000 nodes on 2 cores those were
  // a tenth of the simulator's CPU (issue #37).
  int idle_ EFDL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

class DriverPool::Strand {
 public:
  explicit Strand(Step step) : step_(std::move(step)) {}

 private:
  friend class DriverPool;
  Step step_;
  // Guarded by the pool's mu_.
  bool queued_ = false;     // in ready_
  bool running_ = false;
  bool again_ = false;      // woken while running
  bool closed_ = false;
  std::thread::id runner_;
  TimePoint timer_ = TimePoint::max();   // the deadline it waits for in timers_
};

}  // namespace efdl::rdzv
