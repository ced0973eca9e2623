// The real etcd::Client: unary calls with deadlines and endpoint failover on the caller's
// thread; watches and lease keep-alives on engines (one thread and one stream each) created on
// first use.
#pragma once

#include <atomic>
#include <memory>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "etcd/channel_set.h"

namespace efdl::etcd {

class WatchEngine;
class KeepAliveEngine;

class GrpcClient final : public Client {
 public:
  // `credentials`: from MakeChannelCredentials (nullptr: plaintext). Auth uses options.user and
  // options.password; call Authenticate once before the first call (Connect does).
  GrpcClient(const ClientOptions& options, const std::vector<std::string>& endpoints,
             std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  // Stops the engines' threads. Watches and keepers may outlive the client (they then deliver
  // nothing), but the client must not be destroyed from one of its own callbacks.
  ~GrpcClient() override;

  Result<RangeResult> Range(const std::string& key, const RangeOptions& options) override;
  Result<PutResult> Put(const std::string& key, const std::string& value, int64_t lease) override;
  Result<DeleteResult> Delete(const std::string& key, bool prefix) override;
  Result<TxnResult> Txn(const std::vector<Compare>& compares, const std::vector<TxnOp>& then,
                        const std::vector<TxnOp>& otherwise) override;
  Result<LeaseGrantResult> LeaseGrant(int64_t ttl_seconds) override;
  Status LeaseRevoke(int64_t lease_id) override;
  Result<int64_t> LeaseTimeToLive(int64_t lease_id) override;
  Result<std::unique_ptr<LeaseKeeper>> KeepGranted(const LeaseGrantResult& granted,
                                                   std::chrono::steady_clock::time_point asked,
                                                   std::function<void()> on_lost) override;
  Result<std::unique_ptr<LeaseKeeper>> KeepAlive(int64_t lease_id,
                                                 std::function<void()> on_lost) override;
  Result<std::unique_ptr<Watch>> StartWatch(const std::string& key, const WatchOptions& options,
                                            WatchCallback callback) override;
  Status Compact(int64_t revision) override;
  Result<int64_t> CurrentRevision() override;

  // CurrentRevision with its own time limit (used by Connect and health checks).
  Result<int64_t> Ping(Duration timeout);
  // Gets the first auth token (a no-op without a user).
  Status Authenticate(Duration timeout) { return channels_->Authenticate("", timeout); }

 private:
  // Runs `call(endpoint, context)` with the deadline `timeout` from now, trying the endpoints
  // in turn (starting with the preferred one) while they are unavailable. A call that is not
  // `idempotent` is repeated only when its channel had no connection when it was sent.
  template <class Call>
  Status Unary(std::string_view operation, bool idempotent, Duration timeout, Call&& call);
  // Unary without telling options_.observer.
  template <class Call>
  Status UnaryUnobserved(std::string_view operation, bool idempotent, Duration timeout,
                         Call&& call);

  // Hands lease_id to the keep-alive engine: renewed at ttl_seconds/3, lost after expires_at
  // unless renewed.
  Result<std::unique_ptr<LeaseKeeper>> Keep(int64_t lease_id, int64_t ttl_seconds,
                                            std::chrono::steady_clock::time_point expires_at,
                                            std::function<void()> on_lost);
  std::shared_ptr<WatchEngine> watch_engine();
  std::shared_ptr<KeepAliveEngine> keepalive_engine();

  const ClientOptions options_;
  const std::shared_ptr<ChannelSet> channels_;
  Mutex engines_mu_;
  std::shared_ptr<WatchEngine> watch_ EFDL_GUARDED_BY(engines_mu_);
  std::shared_ptr<KeepAliveEngine> keepalive_ EFDL_GUARDED_BY(engines_mu_);
  // Our etcd user may not read the linearizable ping's key: ping with Maintenance.Status.
  std::atomic<bool> ping_denied_{false};
};

}  // namespace efdl::etcd
