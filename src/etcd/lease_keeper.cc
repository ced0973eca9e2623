#include "etcd/lease_keeper.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace efdl::etcd {

KeepAliveEngine::KeepAliveEngine(std::shared_ptr<ChannelSet> channels, CallObserver* observer)
    : BidiStreamLoop(std::move(channels), "keep-alive"), observer_(observer) {
  StartThread();
}

KeepAliveEngine::~KeepAliveEngine() { Shutdown(); }

void KeepAliveEngine::Shutdown() { StopThread(); }

int64_t KeepAliveEngine::Add(int64_t lease_id, int64_t ttl_seconds, TimePoint expires_at,
                             std::function<void()> on_lost,
                             std::shared_ptr<std::atomic<bool>> lost,
                             std::shared_ptr<std::atomic<int64_t>> expires_ns) {
  int64_t token = 0;
  {
    MutexLock lock(mu_);
    token = next_token_++;
    expires_ns->store(expires_at.time_since_epoch().count());
    entries_.emplace(token,
                     Entry{lease_id, LeaseClock(ttl_seconds, expires_at, SteadyClock::now()),
                           std::make_shared<std::function<void()>>(std::move(on_lost)),
                           std::move(lost), std::move(expires_ns)});
    by_lease_.emplace(lease_id, token);
    fresh_.push_back(token);
  }
  Wake();
  return token;
}

void KeepAliveEngine::Remove(int64_t token) {
  MutexLock lock(mu_);
  if (auto it = entries_.find(token); it != entries_.end()) Erase(it);
  if (!OnLoopThread()) {
    notified_.wait(lock, [&]() EFDL_REQUIRES(mu_) { return notifying_ != token; });
  }
}

bool KeepAliveEngine::WantStream() {
  MutexLock lock(mu_);
  return !entries_.empty();
}

bool KeepAliveEngine::ReconnectUrgently() {
  // Every kept lease is at stake while the stream is down: its local expiry only moves with an
  // answer. To a dead local port or an unreachable member, a try every 100 ms costs little.
  MutexLock lock(mu_);
  return !entries_.empty();
}

std::unique_ptr<KeepAliveEngine::Stream> KeepAliveEngine::Prepare(EndpointChannel& endpoint,
                                                                  grpc::ClientContext* context,
                                                                  grpc::CompletionQueue* cq) {
  return endpoint.lease->PrepareAsyncLeaseKeepAlive(context, cq);
}

void KeepAliveEngine::Erase(std::map<int64_t, Entry>::iterator it) {
  auto [first, last] = by_lease_.equal_range(it->second.lease_id);
  for (auto b = first; b != last; ++b) {
    if (b->second == it->first) {
      by_lease_.erase(b);
      break;
    }
  }
  entries_.erase(it);   // its timers_ entries are skipped when they come up
}

void KeepAliveEngine::MarkLost(int64_t token, std::vector<std::pair<int64_t, Entry>>& out) {
  auto it = entries_.find(token);
  it->second.lost->store(true);
  out.emplace_back(token, std::move(it->second));
  Erase(it);
}

void KeepAliveEngine::NotifyLost(std::vector<std::pair<int64_t, Entry>>& lost) {
  for (auto& [token, entry] : lost) {
    EFDL_LOG_WARN("etcd lease {:x} lost", entry.lease_id);
    if (observer_ != nullptr) observer_->OnLeaseRenewalFailed("lost");
    notifying_ = token;
    mu_.unlock();  // the caller's MutexLock holds it again once this returns
    if (*entry.on_lost) (*entry.on_lost)();
    mu_.lock();
    notifying_ = 0;
    notified_.notify_all();
  }
}

TimePoint KeepAliveEngine::OnTick(TimePoint now) {
  MutexLock lock(mu_);
  std::vector<std::pair<int64_t, Entry>> lost;
  const bool up = stream_up();
  std::vector<int64_t> due;
  if (up != ticked_up_) {
    ticked_up_ = up;   // renewals go out (or stop) for every lease
    for (const auto& [token, e] : entries_) due.push_back(token);
  } else {
    due.swap(fresh_);
    while (!timers_.empty() && timers_.top().first <= now) {
      const auto [when, token] = timers_.top();
      timers_.pop();
      auto it = entries_.find(token);
      if (it == entries_.end() || it->second.queued != when) continue;   // stale
      it->second.queued = TimePoint::max();
      due.push_back(token);
    }
  }
  fresh_.clear();
  std::vector<int64_t> expired;
  for (int64_t token : due) {
    auto it = entries_.find(token);
    if (it == entries_.end()) continue;
    Entry& e = it->second;
    const LeaseClock::Tick tick = e.clock.Advance(now, up);
    if (tick.lost) {
      expired.push_back(token);
      continue;
    }
    if (tick.grace_started) {
      if (observer_ != nullptr) observer_->OnLeaseRenewalFailed("late");
      EFDL_LOG_INFO("etcd lease {:x}: its local expiry passed with no renewal answered; waiting up "
                    "to {} ms more for etcd's answer",
                    e.lease_id, ExpiryGrace(e.clock.ttl_seconds()).count());
    }
    if (tick.send_renewal) {
      etcdserverpb::LeaseKeepAliveRequest request;
      request.set_id(e.lease_id);
      Send(std::move(request));
    }
    // An answer only moves the clock's next wake later: an earlier timer is a harmless no-op.
    if (tick.wake < e.queued) {
      e.queued = tick.wake;
      timers_.emplace(tick.wake, token);
    }
  }
  for (int64_t token : expired) {
    if (entries_.count(token) != 0) MarkLost(token, lost);
  }
  NotifyLost(lost);
  return timers_.empty() ? TimePoint::max() : timers_.top().first;
}

void KeepAliveEngine::OnResponse(const etcdserverpb::LeaseKeepAliveResponse& response) {
  MutexLock lock(mu_);
  std::vector<std::pair<int64_t, Entry>> lost;
  const TimePoint now = SteadyClock::now();
  std::vector<int64_t> gone;
  auto [first, last] = by_lease_.equal_range(response.id());
  for (auto b = first; b != last; ++b) {
    const int64_t token = b->second;
    Entry& e = entries_.at(token);
    switch (e.clock.OnAnswer(now, response.ttl())) {
      case LeaseClock::Answer::kLost:
        gone.push_back(token);
        break;
      case LeaseClock::Answer::kRenewedInGrace:
        EFDL_LOG_INFO("etcd lease {:x}: etcd answered after the local expiry and still has the "
                      "lease ({} s left)",
                      e.lease_id, response.ttl());
        break;
      case LeaseClock::Answer::kRenewed:
      case LeaseClock::Answer::kIgnored:
        break;
    }
    e.expires_ns->store(e.clock.expires_at().time_since_epoch().count());
  }
  for (int64_t token : gone) MarkLost(token, lost);
  NotifyLost(lost);
}

void KeepAliveEngine::OnStreamDown() {
  MutexLock lock(mu_);
  const TimePoint now = SteadyClock::now();
  for (auto& [token, e] : entries_) e.clock.OnStreamDown(now);
}

}  // namespace efdl::etcd
