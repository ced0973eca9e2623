#include "etcd/lease_keeper.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace efdl::etcd {

namespace {

// etcd's own cadence: a third of the TTL, so two renewals may fail before the lease expires.
std::chrono::milliseconds RenewInterval(int64_t ttl_seconds) {
  return std::chrono::milliseconds(ttl_seconds * 1000 / 3);
}

// While a renewal is unanswered, send another this often (a stream may have been re-opened, or
// a request lost with a member that went away).
std::chrono::milliseconds ResendInterval(int64_t ttl_seconds) {
  return std::min(RenewInterval(ttl_seconds), std::chrono::milliseconds(500));
}

}  // namespace

KeepAliveEngine::KeepAliveEngine(std::shared_ptr<ChannelSet> channels)
    : BidiStreamLoop(std::move(channels), "keep-alive") {
  StartThread();
}

KeepAliveEngine::~KeepAliveEngine() { Shutdown(); }

void KeepAliveEngine::Shutdown() { StopThread(); }

int64_t KeepAliveEngine::Add(int64_t lease_id, int64_t ttl_seconds, TimePoint expires_at,
                             std::function<void()> on_lost,
                             std::shared_ptr<std::atomic<bool>> lost) {
  int64_t token = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    token = next_token_++;
    Entry& e = entries_[token];
    e.lease_id = lease_id;
    e.ttl_seconds = std::max<int64_t>(ttl_seconds, 1);
    e.expires_at = expires_at;
    e.next_renewal = SteadyClock::now();  // renew at once: the lease may be old already
    e.on_lost = std::make_shared<std::function<void()>>(std::move(on_lost));
    e.lost = std::move(lost);
  }
  Wake();
  return token;
}

void KeepAliveEngine::Remove(int64_t token) {
  std::unique_lock<std::mutex> lock(mu_);
  entries_.erase(token);
  if (!OnLoopThread()) notified_.wait(lock, [&] { return notifying_ != token; });
}

bool KeepAliveEngine::WantStream() {
  std::lock_guard<std::mutex> lock(mu_);
  return !entries_.empty();
}

std::unique_ptr<KeepAliveEngine::Stream> KeepAliveEngine::Prepare(EndpointChannel& endpoint,
                                                                  grpc::ClientContext* context,
                                                                  grpc::CompletionQueue* cq) {
  return endpoint.lease->PrepareAsyncLeaseKeepAlive(context, cq);
}

void KeepAliveEngine::MarkLost(int64_t token, std::vector<std::pair<int64_t, Entry>>& out) {
  auto it = entries_.find(token);
  it->second.lost->store(true);
  out.emplace_back(token, std::move(it->second));
  entries_.erase(it);
}

void KeepAliveEngine::NotifyLost(std::unique_lock<std::mutex>& lock,
                                 std::vector<std::pair<int64_t, Entry>>& lost) {
  for (auto& [token, entry] : lost) {
    EFDL_LOG_WARN("etcd lease {:x} lost", entry.lease_id);
    notifying_ = token;
    lock.unlock();
    if (*entry.on_lost) (*entry.on_lost)();
    lock.lock();
    notifying_ = 0;
    notified_.notify_all();
  }
}

TimePoint KeepAliveEngine::OnTick(TimePoint now) {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, Entry>> lost;
  TimePoint wake = TimePoint::max();
  const bool up = stream_up();
  std::vector<int64_t> expired;
  for (auto& [token, e] : entries_) {
    if (now >= e.expires_at) {
      expired.push_back(token);
      continue;
    }
    if (up && now >= e.next_renewal) {
      etcdserverpb::LeaseKeepAliveRequest request;
      request.set_id(e.lease_id);
      Send(std::move(request));
      if (!e.unanswered_since) e.unanswered_since = now;
      e.next_renewal = now + ResendInterval(e.ttl_seconds);
    }
    wake = std::min(wake, e.expires_at);
    if (up) wake = std::min(wake, e.next_renewal);
  }
  for (int64_t token : expired) MarkLost(token, lost);
  NotifyLost(lock, lost);
  return wake;
}

void KeepAliveEngine::OnResponse(const etcdserverpb::LeaseKeepAliveResponse& response) {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, Entry>> lost;
  const TimePoint now = SteadyClock::now();
  std::vector<int64_t> gone;
  for (auto& [token, e] : entries_) {
    if (e.lease_id != response.id()) continue;
    if (response.ttl() <= 0) {
      gone.push_back(token);
      continue;
    }
    if (!e.unanswered_since) continue;  // an answer to a renewal we already counted
    const TimePoint sent = *e.unanswered_since;
    e.unanswered_since.reset();
    e.ttl_seconds = response.ttl();
    e.expires_at = std::max(e.expires_at, sent + std::chrono::seconds(response.ttl()));
    e.next_renewal = std::max(now, sent + RenewInterval(response.ttl()));
  }
  for (int64_t token : gone) MarkLost(token, lost);
  NotifyLost(lock, lost);
}

void KeepAliveEngine::OnStreamDown() {
  std::lock_guard<std::mutex> lock(mu_);
  const TimePoint now = SteadyClock::now();
  for (auto& [token, e] : entries_) {
    // Renewals on the dead stream will never be answered; ask again on the next one. The
    // local expiry stays: only an answer extends it.
    e.unanswered_since.reset();
    e.next_renewal = now;
  }
}

}  // namespace efdl::etcd
