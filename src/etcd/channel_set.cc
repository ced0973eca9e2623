#include "etcd/channel_set.h"

#include <fmt/format.h>

namespace efdl::etcd {

namespace {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  // etcd restarts take about a second: try to reconnect soon and often instead of gRPC's
  // default one-second-then-exponential backoff, so calls and streams resume promptly.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // gRPC also uses this as the time one connection attempt may take: too short and a busy
  // machine never completes a handshake.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  // Detect a silently dead peer under an open watch/keep-alive stream. etcd refuses pings more
  // often than every 5 s (--grpc-keepalive-min-time) and without an open stream.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  // We retry (and fail over) ourselves, knowing which calls are safe to repeat.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  // Each client keeps its own connections: two clients in one process behave like two
  // processes (and one client's broken connection does not affect another's).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

ChannelSet::ChannelSet(const std::vector<std::string>& endpoints) {
  endpoints_.reserve(endpoints.size());
  for (const std::string& address : endpoints) {
    EndpointChannel e;
    e.address = address;
    e.channel = MakeChannel(address);
    e.kv = etcdserverpb::KV::NewStub(e.channel);
    e.lease = etcdserverpb::Lease::NewStub(e.channel);
    e.watch = etcdserverpb::Watch::NewStub(e.channel);
    endpoints_.push_back(std::move(e));
  }
}

void ChannelSet::MarkBad(size_t i) {
  size_t expected = i;
  preferred_.compare_exchange_strong(expected, (i + 1) % endpoints_.size(),
                                     std::memory_order_relaxed);
}

std::string ChannelSet::Describe() const {
  std::string out;
  for (const auto& e : endpoints_) {
    if (!out.empty()) out += ", ";
    out += e.address;
  }
  return out;
}

Status FromGrpc(const grpc::Status& status, std::string_view operation,
                std::string_view endpoint) {
  const std::string& msg = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
      return Status::OK();
    case grpc::StatusCode::INVALID_ARGUMENT:
      return Status::InvalidArgument(
          fmt::format("etcd {} rejected by {}: {}", operation, endpoint, msg));
    case grpc::StatusCode::NOT_FOUND:
      return Status::NotFound(fmt::format("etcd {} at {}: {}", operation, endpoint, msg));
    case grpc::StatusCode::OUT_OF_RANGE:  // "mvcc: required revision has been compacted"
    case grpc::StatusCode::FAILED_PRECONDITION:
      return Status::FailedPrecondition(
          fmt::format("etcd {} at {}: {}", operation, endpoint, msg));
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return Status::DeadlineExceeded(fmt::format(
          "etcd {} at {} got no answer in time ({}); check that etcd is up and not overloaded",
          operation, endpoint, msg));
    case grpc::StatusCode::CANCELLED:
      return Status::Cancelled(
          fmt::format("etcd {} at {} cancelled: {}", operation, endpoint, msg));
    case grpc::StatusCode::UNAVAILABLE:
      return Status::Unavailable(fmt::format(
          "etcd {} failed: {} is unavailable ({}); check that etcd runs there", operation,
          endpoint, msg));
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return Status::Unavailable(fmt::format("etcd {} at {}: {} (request too large or server "
                                             "overloaded)", operation, endpoint, msg));
    default:
      return Status::Internal(fmt::format("etcd {} at {}: gRPC error {}: {}", operation, endpoint,
                                          static_cast<int>(status.error_code()), msg));
  }
}

bool IsRetriableGrpc(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE;
}

}  // namespace efdl::etcd
