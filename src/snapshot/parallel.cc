#include "snapshot/parallel.h"

namespace efdl::snapshot {

ParallelRunner::ParallelRunner(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ParallelRunner::~ParallelRunner() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ParallelRunner::Drain(const std::function<void(size_t)>& fn, size_t n) {
  for (size_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i);
}

void ParallelRunner::Run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    MutexLock lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    ++generation_;
  }
  cv_.notify_all();
  Drain(fn, n);
  MutexLock lock(mu_);
  // Workers that woke for this generation are counted in busy_; wait until all have left Drain().
  done_cv_.wait(lock, [&]() EFDL_REQUIRES(mu_) { return busy_ == 0; });
  fn_ = nullptr;
}

void ParallelRunner::WorkerLoop() {
  uint64_t seen = 0;
  MutexLock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&]() EFDL_REQUIRES(mu_) { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (fn_ == nullptr) continue;  // woke after that run had finished
    const auto* fn = fn_;
    size_t n = n_;
    ++busy_;
    lock.unlock();
    Drain(*fn, n);
    lock.lock();
    if (--busy_ == 0) done_cv_.notify_all();
  }
}

}  // namespace efdl::snapshot
