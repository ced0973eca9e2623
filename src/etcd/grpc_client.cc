#include "etcd/grpc_client.h"

#include <fmt/format.h>

#include <grpc/support/log.h>

#include <algorithm>
#include <mutex>  // std::call_once
#include <thread>

#include "common/log.h"
#include "etcd/convert.h"
#include "etcd/lease_keeper.h"
#include "etcd/tls_probe.h"
#include "etcd/watcher.h"

namespace efdl::etcd {

namespace {

using etcdserverpb::Compare_CompareResult;
using etcdserverpb::Compare_CompareTarget;

Status CheckKey(const std::string& key, std::string_view what) {
  if (key.empty()) {
    return Status::InvalidArgument(fmt::format(
        "etcd {}: the key is empty; give a non-empty key (or prefix)", what));
  }
  return Status::OK();
}

std::chrono::system_clock::time_point ToSystem(TimePoint deadline) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline -
                                                                         SteadyClock::now());
}

RangeResult ToRangeResult(const etcdserverpb::RangeResponse& response) {
  RangeResult out;
  out.kvs.reserve(static_cast<size_t>(response.kvs_size()));
  for (const auto& kv : response.kvs()) out.kvs.push_back(ToKeyValue(kv));
  out.count = response.count();
  out.more = response.more();
  out.revision = response.header().revision();
  return out;
}

Status BuildRange(const std::string& key, const RangeOptions& o,
                  etcdserverpb::RangeRequest* request) {
  EFDL_RETURN_IF_ERROR(CheckKey(key, "range"));
  if (o.limit < 0 || o.revision < 0 || o.min_create_revision < 0 || o.max_create_revision < 0 ||
      o.min_mod_revision < 0 || o.max_mod_revision < 0) {
    return Status::InvalidArgument(fmt::format(
        "etcd range on '{}': limit and revisions must not be negative (0 means unset)", key));
  }
  request->set_key(key);
  if (o.prefix) request->set_range_end(PrefixRangeEnd(key));
  request->set_limit(o.limit);
  request->set_revision(o.revision);
  request->set_keys_only(o.keys_only);
  request->set_count_only(o.count_only);
  request->set_sort_order(static_cast<etcdserverpb::RangeRequest::SortOrder>(o.sort_order));
  request->set_sort_target(static_cast<etcdserverpb::RangeRequest::SortTarget>(o.sort_target));
  request->set_min_create_revision(o.min_create_revision);
  request->set_max_create_revision(o.max_create_revision);
  request->set_min_mod_revision(o.min_mod_revision);
  request->set_max_mod_revision(o.max_mod_revision);
  return Status::OK();
}

Status BuildOp(const TxnOp& op, etcdserverpb::RequestOp* out) {
  EFDL_RETURN_IF_ERROR(CheckKey(op.key, "transaction operation"));
  switch (op.type) {
    case TxnOp::Type::kPut: {
      auto* put = out->mutable_request_put();
      put->set_key(op.key);
      put->set_value(op.value);
      put->set_lease(op.lease);
      break;
    }
    case TxnOp::Type::kDelete: {
      auto* del = out->mutable_request_delete_range();
      del->set_key(op.key);
      if (op.prefix) del->set_range_end(PrefixRangeEnd(op.key));
      break;
    }
    case TxnOp::Type::kGet: {
      auto* range = out->mutable_request_range();
      range->set_key(op.key);
      if (op.prefix) range->set_range_end(PrefixRangeEnd(op.key));
      break;
    }
  }
  return Status::OK();
}

Status BuildCompare(const Compare& c, etcdserverpb::Compare* out) {
  EFDL_RETURN_IF_ERROR(CheckKey(c.key, "transaction compare"));
  out->set_key(c.key);
  switch (c.op) {
    case Compare::Op::kEqual: out->set_result(etcdserverpb::Compare::EQUAL); break;
    case Compare::Op::kGreater: out->set_result(etcdserverpb::Compare::GREATER); break;
    case Compare::Op::kLess: out->set_result(etcdserverpb::Compare::LESS); break;
    case Compare::Op::kNotEqual: out->set_result(etcdserverpb::Compare::NOT_EQUAL); break;
  }
  switch (c.target) {
    case Compare::Target::kVersion:
      out->set_target(etcdserverpb::Compare::VERSION);
      out->set_version(c.number);
      break;
    case Compare::Target::kCreateRevision:
      out->set_target(etcdserverpb::Compare::CREATE);
      out->set_create_revision(c.number);
      break;
    case Compare::Target::kModRevision:
      out->set_target(etcdserverpb::Compare::MOD);
      out->set_mod_revision(c.number);
      break;
    case Compare::Target::kValue:
      out->set_target(etcdserverpb::Compare::VALUE);
      out->set_value(c.value);
      break;
  }
  return Status::OK();
}

// gRPC prints its own errors (a failed TLS handshake: several "E... ssl_transport_security"
// lines) straight to stderr, around our one-line messages that already say what went wrong.
// Its log goes to ours at debug level instead. gRPC's log sink is process-wide; set once.
void RouteGrpcLogToDebug() {
  static std::once_flag once;
  std::call_once(once, [] {
    gpr_set_log_function([](gpr_log_func_args* args) {
      EFDL_LOG_DEBUG("grpc {}:{}: {}", args->file != nullptr ? args->file : "?", args->line,
                     args->message != nullptr ? args->message : "");
    });
  });
}

class GrpcLeaseKeeper final : public LeaseKeeper {
 public:
  GrpcLeaseKeeper(std::shared_ptr<KeepAliveEngine> engine, int64_t token, int64_t lease_id,
                  std::shared_ptr<std::atomic<bool>> lost,
                  std::shared_ptr<std::atomic<int64_t>> expires_ns)
      : engine_(std::move(engine)),
        token_(token),
        lease_id_(lease_id),
        lost_(std::move(lost)),
        expires_ns_(std::move(expires_ns)) {}
  ~GrpcLeaseKeeper() override { engine_->Remove(token_); }
  int64_t lease_id() const override { return lease_id_; }
  bool lost() const override { return lost_->load(); }
  TimePoint expires_at() const override {
    return TimePoint(TimePoint::duration(expires_ns_->load()));
  }

 private:
  std::shared_ptr<KeepAliveEngine> engine_;
  int64_t token_;
  int64_t lease_id_;
  std::shared_ptr<std::atomic<bool>> lost_;
  std::shared_ptr<std::atomic<int64_t>> expires_ns_;
};

class GrpcWatch final : public Watch {
 public:
  GrpcWatch(std::shared_ptr<WatchEngine> engine, int64_t id, std::chrono::milliseconds timeout)
      : engine_(std::move(engine)), id_(id), timeout_(timeout) {}
  ~GrpcWatch() override { engine_->Remove(id_); }
  // A callback cannot wait: the acknowledgement comes on its thread.
  Status WaitCreated() override {
    return engine_->OnLoopThread() ? Status::OK() : engine_->WaitCreated(id_, timeout_);
  }

 private:
  std::shared_ptr<WatchEngine> engine_;
  int64_t id_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

GrpcClient::GrpcClient(const ClientOptions& options, const std::vector<std::string>& endpoints,
                       std::shared_ptr<grpc::ChannelCredentials> credentials)
    : options_(options),
      channels_(std::make_shared<ChannelSet>(endpoints, std::move(credentials), options.user,
                                             options.password)) {
  RouteGrpcLogToDebug();
}

GrpcClient::~GrpcClient() {
  MutexLock lock(engines_mu_);
  if (watch_) watch_->Shutdown();
  if (keepalive_) keepalive_->Shutdown();
}

std::shared_ptr<WatchEngine> GrpcClient::watch_engine() {
  MutexLock lock(engines_mu_);
  if (!watch_) watch_ = std::make_shared<WatchEngine>(channels_);
  return watch_;
}

std::shared_ptr<KeepAliveEngine> GrpcClient::keepalive_engine() {
  MutexLock lock(engines_mu_);
  if (!keepalive_) keepalive_ = std::make_shared<KeepAliveEngine>(channels_, options_.observer);
  return keepalive_;
}

template <class Call>
Status GrpcClient::Unary(std::string_view operation, bool idempotent, Duration timeout,
                         Call&& call) {
  if (options_.observer == nullptr) {
    return UnaryUnobserved(operation, idempotent, timeout, std::forward<Call>(call));
  }
  const TimePoint began = SteadyClock::now();
  Status st = UnaryUnobserved(operation, idempotent, timeout, std::forward<Call>(call));
  options_.observer->OnCall(
      operation, std::chrono::duration<double>(SteadyClock::now() - began).count(), st.ok());
  return st;
}

template <class Call>
Status GrpcClient::UnaryUnobserved(std::string_view operation, bool idempotent,
                                   Duration timeout, Call&& call) {
  const TimePoint deadline = SteadyClock::now() + timeout;
  const size_t n = channels_->size();
  size_t i = channels_->preferred();
  size_t tried_this_round = 0;
  std::chrono::milliseconds pause{20};
  std::vector<std::string> last_error(n);
  std::string token = channels_->auth_enabled() ? channels_->token() : std::string();
  bool reauthenticated = false;
  while (true) {
    EndpointChannel& endpoint = channels_->at(i);
    const bool was_ready = endpoint.channel->GetState(false) == GRPC_CHANNEL_READY;
    TimePoint attempt_deadline = deadline;
    // With other endpoints to try, do not spend the whole deadline connecting to one.
    if (!was_ready && n > 1) {
      attempt_deadline = std::min(deadline, SteadyClock::now() + options_.connect_timeout);
    }
    grpc::ClientContext context;
    context.set_deadline(ToSystem(attempt_deadline));
    ChannelSet::AttachToken(&context, token);
    const grpc::Status status = call(endpoint, &context);
    if (status.ok()) {
      channels_->MarkGood(i);
      if (!token.empty()) channels_->NoteTokenUsed();
      return Status::OK();
    }
    // etcd forgot or outdated our token (expiry after disuse, a restart, an auth change): it
    // did not execute the call, so get a new token and repeat it, once.
    if (channels_->auth_enabled() && !reauthenticated && IsStaleTokenGrpc(status)) {
      reauthenticated = true;
      const auto left = std::chrono::duration_cast<Duration>(deadline - SteadyClock::now());
      EFDL_RETURN_IF_ERROR(channels_->Authenticate(token, std::max(left, Duration(1))));
      token = channels_->token();
      continue;
    }
    const bool cut_short = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                           attempt_deadline < deadline;
    if (!((IsRetriableGrpc(status) || cut_short) && (idempotent || !was_ready))) {
      const bool failed_before = std::any_of(last_error.begin(), last_error.end(),
                                             [](const std::string& e) { return !e.empty(); });
      // Out of time after endpoints were found down: say that, not just "deadline exceeded".
      if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && failed_before) break;
      return FromGrpc(status, operation, endpoint.address);
    }
    last_error[i] = fmt::format("{}: {}", endpoint.address, status.error_message());
    channels_->MarkBad(i);
    i = (i + 1) % n;
    if (++tried_this_round >= n) {
      tried_this_round = 0;
      // Every endpoint failed: wait a little (etcd may be restarting), up to the deadline.
      const auto left = deadline - SteadyClock::now();
      if (left <= std::chrono::milliseconds(5)) break;
      std::this_thread::sleep_for(std::min<SteadyClock::duration>(pause, left));
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
    }
    if (SteadyClock::now() >= deadline - std::chrono::milliseconds(5)) break;
  }
  std::string errors;
  for (const auto& e : last_error) {
    if (e.empty()) continue;
    if (!errors.empty()) errors += "; ";
    errors += e;
  }
  return Status::Unavailable(fmt::format(
      "etcd {} failed: no endpoint answered within {} ms ({}); check that etcd runs at {} "
      "(`efdl etcd` starts one)",
      operation, timeout.count(), errors, channels_->Describe()));
}

Result<RangeResult> GrpcClient::Range(const std::string& key, const RangeOptions& options) {
  etcdserverpb::RangeRequest request;
  EFDL_RETURN_IF_ERROR(BuildRange(key, options, &request));
  etcdserverpb::RangeResponse response;
  EFDL_RETURN_IF_ERROR(Unary("range", true, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.kv->Range(ctx, request, &response);
                             }));
  return ToRangeResult(response);
}

Result<PutResult> GrpcClient::Put(const std::string& key, const std::string& value,
                                  int64_t lease) {
  EFDL_RETURN_IF_ERROR(CheckKey(key, "put"));
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  EFDL_RETURN_IF_ERROR(Unary("put", false, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.kv->Put(ctx, request, &response);
                             }));
  return PutResult{response.header().revision()};
}

Result<DeleteResult> GrpcClient::Delete(const std::string& key, bool prefix) {
  EFDL_RETURN_IF_ERROR(CheckKey(key, "delete"));
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(key);
  if (prefix) request.set_range_end(PrefixRangeEnd(key));
  etcdserverpb::DeleteRangeResponse response;
  EFDL_RETURN_IF_ERROR(Unary("delete", false, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.kv->DeleteRange(ctx, request, &response);
                             }));
  return DeleteResult{response.deleted(), response.header().revision()};
}

Result<TxnResult> GrpcClient::Txn(const std::vector<Compare>& compares,
                                  const std::vector<TxnOp>& then,
                                  const std::vector<TxnOp>& otherwise) {
  etcdserverpb::TxnRequest request;
  for (const Compare& c : compares) EFDL_RETURN_IF_ERROR(BuildCompare(c, request.add_compare()));
  for (const TxnOp& op : then) EFDL_RETURN_IF_ERROR(BuildOp(op, request.add_success()));
  for (const TxnOp& op : otherwise) EFDL_RETURN_IF_ERROR(BuildOp(op, request.add_failure()));
  etcdserverpb::TxnResponse response;
  EFDL_RETURN_IF_ERROR(Unary("transaction", false, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.kv->Txn(ctx, request, &response);
                             }));
  TxnResult out;
  out.succeeded = response.succeeded();
  out.revision = response.header().revision();
  for (const auto& r : response.responses()) {
    if (r.has_response_range()) out.gets.push_back(ToRangeResult(r.response_range()));
  }
  return out;
}

Result<LeaseGrantResult> GrpcClient::LeaseGrant(int64_t ttl_seconds) {
  if (ttl_seconds <= 0) {
    return Status::InvalidArgument(
        fmt::format("etcd lease grant: TTL must be at least 1 second, got {}", ttl_seconds));
  }
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse response;
  EFDL_RETURN_IF_ERROR(Unary("lease grant", false, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.lease->LeaseGrant(ctx, request, &response);
                             }));
  if (!response.error().empty()) {
    return Status::Internal(fmt::format("etcd lease grant: {}", response.error()));
  }
  return LeaseGrantResult{response.id(), response.ttl()};
}

Status GrpcClient::LeaseRevoke(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse response;
  return Unary("lease revoke", true, options_.call_timeout,
               [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                 return e.lease->LeaseRevoke(ctx, request, &response);
               });
}

Result<int64_t> GrpcClient::LeaseTimeToLive(int64_t lease_id) {
  etcdserverpb::LeaseTimeToLiveRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseTimeToLiveResponse response;
  EFDL_RETURN_IF_ERROR(Unary("lease time-to-live", true, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.lease->LeaseTimeToLive(ctx, request, &response);
                             }));
  if (response.ttl() < 0) {
    return Status::NotFound(
        fmt::format("etcd lease {:x} not found (it expired or was revoked)", lease_id));
  }
  return response.ttl();
}

Result<std::unique_ptr<LeaseKeeper>> GrpcClient::KeepAlive(int64_t lease_id,
                                                           std::function<void()> on_lost) {
  // Learn the granted TTL (the renewal cadence) and a safe local expiry, and make sure the
  // lease exists before promising to keep it.
  const TimePoint asked = SteadyClock::now();
  etcdserverpb::LeaseTimeToLiveRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseTimeToLiveResponse response;
  EFDL_RETURN_IF_ERROR(Unary("lease keep-alive", true, options_.call_timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.lease->LeaseTimeToLive(ctx, request, &response);
                             }));
  if (response.ttl() <= 0) {
    return Status::NotFound(fmt::format(
        "etcd lease {:x} cannot be kept alive: it expired or was revoked", lease_id));
  }
  return Keep(lease_id, response.grantedttl(), asked + std::chrono::seconds(response.ttl()),
              std::move(on_lost));
}

Result<std::unique_ptr<LeaseKeeper>> GrpcClient::KeepGranted(const LeaseGrantResult& granted,
                                                             TimePoint asked,
                                                             std::function<void()> on_lost) {
  if (granted.id == 0 || granted.ttl_seconds <= 0) {
    return Status::InvalidArgument("KeepGranted needs the answer of a lease grant");
  }
  // The grant's answer is the lease's whole TTL, counted from before the grant was sent.
  return Keep(granted.id, granted.ttl_seconds, asked + std::chrono::seconds(granted.ttl_seconds),
              std::move(on_lost));
}

Result<std::unique_ptr<LeaseKeeper>> GrpcClient::Keep(int64_t lease_id, int64_t ttl_seconds,
                                                      TimePoint expires_at,
                                                      std::function<void()> on_lost) {
  auto lost = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<KeepAliveEngine> engine = keepalive_engine();
  auto expires_ns = std::make_shared<std::atomic<int64_t>>(0);
  int64_t token = engine->Add(lease_id, ttl_seconds, expires_at, std::move(on_lost), lost,
                              expires_ns);
  return std::unique_ptr<LeaseKeeper>(std::make_unique<GrpcLeaseKeeper>(
      std::move(engine), token, lease_id, std::move(lost), std::move(expires_ns)));
}

Result<std::unique_ptr<Watch>> GrpcClient::StartWatch(const std::string& key,
                                                      const WatchOptions& options,
                                                      WatchCallback callback) {
  EFDL_RETURN_IF_ERROR(CheckKey(key, "watch"));
  if (!callback) return Status::InvalidArgument("etcd watch on '" + key + "': no callback given");
  if (options.start_revision < 0) {
    return Status::InvalidArgument(fmt::format(
        "etcd watch on '{}': start revision {} is negative (0 means from now)", key,
        options.start_revision));
  }
  int64_t start = options.start_revision;
  if (start == 0) {
    // "From now" is pinned to a revision here, so no event after this call is missed even if
    // the stream is still connecting, and a resumed watch knows where to start.
    EFDL_ASSIGN_OR_RETURN(int64_t now, CurrentRevision());
    start = now + 1;
  }
  std::shared_ptr<WatchEngine> engine = watch_engine();
  int64_t id = engine->Add(key, options.prefix ? PrefixRangeEnd(key) : std::string(), start,
                           options.progress_notify, std::move(callback));
  auto watch = std::make_unique<GrpcWatch>(engine, id, options_.call_timeout);
  // Return once etcd serves the watch (unless the caller waits later): its first events then
  // arrive as fast as any later ones (a watch created behind the store's revision is caught up
  // only by etcd's 100 ms sync loop).
  if (options.wait_created) EFDL_RETURN_IF_ERROR(watch->WaitCreated());
  return std::unique_ptr<Watch>(std::move(watch));
}

Status GrpcClient::Compact(int64_t revision) {
  if (revision <= 0) {
    return Status::InvalidArgument(
        fmt::format("etcd compact: revision must be positive, got {}", revision));
  }
  etcdserverpb::CompactionRequest request;
  request.set_revision(revision);
  etcdserverpb::CompactionResponse response;
  return Unary("compact", true, options_.call_timeout,
               [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                 return e.kv->Compact(ctx, request, &response);
               });
}

Result<int64_t> GrpcClient::CurrentRevision() { return Ping(options_.call_timeout); }

Result<int64_t> GrpcClient::Ping(Duration timeout) {
  etcdserverpb::RangeRequest request;
  request.set_key(std::string(1, '\0'));
  request.set_count_only(true);
  etcdserverpb::RangeResponse response;
  if (!ping_denied_.load(std::memory_order_relaxed)) {
    Status st = Unary("status check", true, timeout,
                      [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                        return e.kv->Range(ctx, request, &response);
                      });
    if (st.ok()) return response.header().revision();
    // An etcd user whose role covers only the job's prefix may not read this key.
    if (!channels_->auth_enabled() || st.message().find("permission denied") == std::string::npos) {
      return st;
    }
    ping_denied_.store(true, std::memory_order_relaxed);
  }
  // Maintenance.Status needs no key permission; it is served by the member alone (not
  // linearizable), which for a "from now" watch start only means a few events more.
  etcdserverpb::StatusRequest status_request;
  etcdserverpb::StatusResponse status_response;
  EFDL_RETURN_IF_ERROR(Unary("status check", true, timeout,
                             [&](EndpointChannel& e, grpc::ClientContext* ctx) {
                               return e.maintenance->Status(ctx, status_request, &status_response);
                             }));
  return status_response.header().revision();
}

Result<std::unique_ptr<Client>> Connect(const ClientOptions& options) {
  if (options.endpoints.empty()) {
    return Status::InvalidArgument(
        "no etcd endpoints given; pass host:port[,host:port...], e.g. 127.0.0.1:2379");
  }
  if (options.call_timeout.count() <= 0 || options.connect_timeout.count() <= 0) {
    return Status::InvalidArgument("etcd client: call_timeout and connect_timeout must be > 0");
  }
  std::vector<std::string> endpoints;
  for (const std::string& e : options.endpoints) {
    EFDL_ASSIGN_OR_RETURN(std::vector<std::string> parsed, ParseEndpoints(e));
    endpoints.insert(endpoints.end(), parsed.begin(), parsed.end());
  }
  if (options.user.empty() && !options.password.empty()) {
    return Status::InvalidArgument(
        "an etcd password was given without a user: give --etcd-user (or EFDL_ETCD_USER) too");
  }
  EFDL_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options.tls));
  auto client = std::make_unique<GrpcClient>(options, endpoints, credentials);
  // A failed handshake shows as "unavailable": say which TLS setting is the likely cause.
  auto explain = [&](const Status& st) {
    std::string advice;
    if (st.code() == Status::Code::kUnavailable || st.code() == Status::Code::kDeadlineExceeded) {
      for (const std::string& endpoint : endpoints) {
        advice = DiagnoseTlsEndpoint(endpoint, options.tls, std::chrono::milliseconds(1500));
        if (!advice.empty()) {
          advice = fmt::format("{}: {}", endpoint, advice);
          break;
        }
      }
    }
    Status out = advice.empty() ? st : Status::Unavailable(advice + " (" + st.message() + ")");
    return out.WithContext("cannot connect to etcd");
  };
  if (Status st = client->Authenticate(options.connect_timeout); !st.ok()) return explain(st);
  auto revision = client->Ping(options.connect_timeout);
  if (!revision.ok()) return explain(revision.status());
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace efdl::etcd
