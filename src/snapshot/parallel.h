// A small fixed pool that runs "for i in [0, n): fn(i)" on its threads plus the caller's.
//
// Owned by one SnapshotEngine (or one Persister); Run() is called from one thread at a time.
// The destructor stops and joins the threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"

namespace efdl::snapshot {

class ParallelRunner {
 public:
  explicit ParallelRunner(int threads);  // total, including the caller; <=1: caller only
  ~ParallelRunner();
  ParallelRunner(const ParallelRunner&) = delete;
  ParallelRunner& operator=(const ParallelRunner&) = delete;

  void Run(size_t n, const std::function<void(size_t)>& fn);
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  void WorkerLoop();
  void Drain(const std::function<void(size_t)>& fn, size_t n);

  Mutex mu_;
  std::condition_variable_any cv_;
  std::condition_variable_any done_cv_;
  const std::function<void(size_t)>* fn_ EFDL_GUARDED_BY(mu_) = nullptr;  // set per Run
  size_t n_ EFDL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ EFDL_GUARDED_BY(mu_) = 0;
  int busy_ EFDL_GUARDED_BY(mu_) = 0;
  bool stop_ EFDL_GUARDED_BY(mu_) = false;
  std::atomic<size_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace efdl::snapshot
