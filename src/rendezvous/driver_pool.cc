#include "rendezvous/driver_pool.h"

#include <algorithm>

namespace efdl::rdzv {

DriverPool::DriverPool(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

DriverPool::~DriverPool() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::shared_ptr<DriverPool::Strand> DriverPool::NewStrand(Step step) {
  return std::make_shared<Strand>(std::move(step));
}

bool DriverPool::Schedule(const std::shared_ptr<Strand>& s) {
  if (s->closed_) return false;
  if (s->running_) {
    s->again_ = true;
    return false;
  }
  if (s->queued_) return false;
  s->queued_ = true;
  ready_.push_back(s);
  return idle_ > 0;
}

void DriverPool::Wake(const std::shared_ptr<Strand>& strand) {
  bool notify = false;
  {
    MutexLock lock(mu_);
    notify = Schedule(strand);
  }
  if (notify) cv_.notify_one();
}

void DriverPool::Close(const std::shared_ptr<Strand>& strand) {
  MutexLock lock(mu_);
  strand->closed_ = true;
  if (strand->runner_ == std::this_thread::get_id()) return;
  idle_cv_.wait(lock, [&]() EFDL_REQUIRES(mu_) { return !strand->running_; });
}

void DriverPool::Run() {
  MutexLock lock(mu_);
  while (true) {
    // Due timers make their strands ready; a timer whose strand set a newer one is stale.
    const TimePoint now = Clock::now();
    while (!timers_.empty() && timers_.top().first <= now) {
      Timer t = timers_.top();
      timers_.pop();
      if (t.second->timer_ != t.first) continue;
      t.second->timer_ = TimePoint::max();
      // This thread takes the first ready strand itself; others go to waiting threads.
      if (Schedule(t.second) && ready_.size() > 1) cv_.notify_one();
    }
    if (stop_) return;
    if (ready_.empty()) {
      ++idle_;
      if (timers_.empty()) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, timers_.top().first);
      }
      --idle_;
      continue;
    }
    std::shared_ptr<Strand> s = std::move(ready_.front());
    ready_.pop_front();
    s->queued_ = false;
    if (s->closed_) continue;
    s->running_ = true;
    s->runner_ = std::this_thread::get_id();
    lock.unlock();
    std::optional<TimePoint> next = s->step_();
    lock.lock();
    s->running_ = false;
    s->runner_ = std::thread::id();
    if (s->closed_) {
      idle_cv_.notify_all();
      continue;
    }
    // Woken while it ran: ready again; this thread comes back to the ready queue itself.
    if (std::exchange(s->again_, false)) Schedule(s);
    if (next && *next < s->timer_) {
      // A thread waiting for a later timer must wait for this one instead; one waiting for an
      // earlier timer (or none waiting) wakes in time anyway.
      const bool earliest = timers_.empty() || *next < timers_.top().first;
      s->timer_ = *next;
      timers_.emplace(*next, s);
      if (earliest && idle_ > 0) cv_.notify_one();
    }
  }
}

}  // namespace efdl::rdzv
