// The keep-alive engine: every lease kept alive by one client, renewed over one LeaseKeepAlive
// stream by one thread (never a caller's or a Python thread).
//
// When to renew and when a lease is lost is decided by its LeaseClock (lease_clock.h): lost —
// and its owner told, once — when etcd answers a renewal with TTL <= 0, or when etcd has not
// answered one by a short grace after the local expiry. While leases are kept, a broken stream is
// re-opened every 100 ms (and gRPC's own connect backoff skipped), so a restarted etcd is reached
// about 100 ms after it serves again.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <queue>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "etcd/bidi_stream_loop.h"
#include "etcd/lease_clock.h"
#include "rpc.grpc.pb.h"

namespace efdl::etcd {

class KeepAliveEngine final
    : public BidiStreamLoop<etcdserverpb::LeaseKeepAliveRequest,
                            etcdserverpb::LeaseKeepAliveResponse> {
 public:
  // `observer` (null: none) is told of renewals that fail (CallObserver::OnLeaseRenewalFailed).
  explicit KeepAliveEngine(std::shared_ptr<ChannelSet> channels,
                           CallObserver* observer = nullptr);
  ~KeepAliveEngine() override;

  // Starts renewing `lease_id` (granted for `ttl_seconds`, known to live until `expires_at`).
  // `lost` is set and `on_lost` run (on the engine thread) when the lease is lost. Returns a
  // token for Remove.
  // `expires_ns` follows the lease's local expiry (steady clock, ns since its epoch).
  int64_t Add(int64_t lease_id, int64_t ttl_seconds, TimePoint expires_at,
              std::function<void()> on_lost, std::shared_ptr<std::atomic<bool>> lost,
              std::shared_ptr<std::atomic<int64_t>> expires_ns);
  // Stops renewing. Unless called from on_lost itself, waits until that callback is not
  // running; it never runs afterwards.
  void Remove(int64_t token);
  void Shutdown();

 private:
  struct Entry {
    int64_t lease_id = 0;
    LeaseClock clock;
    std::shared_ptr<std::function<void()>> on_lost;
    std::shared_ptr<std::atomic<bool>> lost;
    std::shared_ptr<std::atomic<int64_t>> expires_ns;
    TimePoint queued = TimePoint::max();   // the earliest time this entry waits for in timers_
  };
  using Timer = std::pair<TimePoint, int64_t>;   // (when, token)

  bool WantStream() override;
  std::unique_ptr<Stream> Prepare(EndpointChannel& endpoint, grpc::ClientContext* context,
                                  grpc::CompletionQueue* cq) override;
  void OnStreamUp() override {}
  void OnResponse(const etcdserverpb::LeaseKeepAliveResponse& response) override;
  void OnStreamDown() override;
  TimePoint OnTick(TimePoint now) override;
  bool ReconnectUrgently() override;

  // Moves `token` out of the table as lost; its callback is then run by NotifyLost.
  void MarkLost(int64_t token, std::vector<std::pair<int64_t, Entry>>& out) EFDL_REQUIRES(mu_);
  void Erase(std::map<int64_t, Entry>::iterator it) EFDL_REQUIRES(mu_);
  // Runs the callbacks of `lost` one by one: mu_ is held on entry and exit, released while a
  // callback runs.
  void NotifyLost(std::vector<std::pair<int64_t, Entry>>& lost) EFDL_REQUIRES(mu_);

  CallObserver* const observer_;
  Mutex mu_;
  std::condition_variable_any notified_;
  std::map<int64_t, Entry> entries_ EFDL_GUARDED_BY(mu_);  // by token
  // So that one process can keep 10,000 leases (efdl sim, issue #37), nothing here costs
  // O(leases) per renewal: answers find their lease through by_lease_, and a tick advances only
  // the clocks that are due (timers_, a heap with stale entries skipped: an entry's time is its
  // `queued`), the ones added since (fresh_), or all of them when the stream went up or down.
  std::multimap<int64_t, int64_t> by_lease_ EFDL_GUARDED_BY(mu_);   // lease id -> token
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_
      EFDL_GUARDED_BY(mu_);
  std::vector<int64_t> fresh_ EFDL_GUARDED_BY(mu_);
  bool ticked_up_ EFDL_GUARDED_BY(mu_) = false;   // stream_up() at the last tick
  int64_t next_token_ EFDL_GUARDED_BY(mu_) = 1;
  int64_t notifying_ EFDL_GUARDED_BY(mu_) = 0;  // token whose on_lost runs now
};

}  // namespace efdl::etcd
