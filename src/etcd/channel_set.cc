#include "etcd/channel_set.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/log.h"

namespace efdl::etcd {

namespace {

using SteadyClock = std::chrono::steady_clock;

// etcd 3.4's fixed error texts (etcdserver/api/v3rpc/rpctypes): stable, and the only way to
// tell its auth failures apart (several share a gRPC code).
constexpr std::string_view kAuthFailed = "authentication failed, invalid user ID or password";
constexpr std::string_view kAuthNotEnabled = "authentication is not enabled";
constexpr std::string_view kInvalidToken = "invalid auth token";
constexpr std::string_view kUserEmpty = "user name is empty";
constexpr std::string_view kPermissionDenied = "permission denied";
constexpr std::string_view kAuthOldRevision = "revision of auth store is old";

// No call used the token for this long: re-authenticate before opening a stream. Well under
// etcd's default --auth-token-ttl (300 s), after which an unused simple token is forgotten.
constexpr auto kStreamTokenMaxAge = std::chrono::seconds(60);

bool Contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

Result<std::string> ReadPem(const std::string& path, std::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::InvalidArgument(fmt::format(
        "{} '{}': cannot read the file ({}); give a readable PEM file", flag, path,
        std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return Status::InvalidArgument(fmt::format(
        "{} '{}': not a PEM file (no -----BEGIN line); give the PEM-encoded file", flag, path));
  }
  return text.str();
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::shared_ptr<grpc::ChannelCredentials>& creds) {
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
  return grpc::CreateCustomChannel(address, creds ? creds : grpc::InsecureChannelCredentials(),
                                   args);
}

}  // namespace

Result<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls) {
  if (!tls.enabled()) return std::shared_ptr<grpc::ChannelCredentials>();
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return Status::InvalidArgument(
        "--etcd-cert and --etcd-key go together: give both (the client certificate and its "
        "private key) or neither");
  }
  grpc::SslCredentialsOptions ssl;
  if (!tls.ca_file.empty()) {
    EFDL_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(tls.ca_file, "--etcd-cacert"));
  }
  if (!tls.cert_file.empty()) {
    EFDL_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem(tls.cert_file, "--etcd-cert"));
    EFDL_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(tls.key_file, "--etcd-key"));
  }
  return grpc::SslCredentials(ssl);
}

ChannelSet::ChannelSet(const std::vector<std::string>& endpoints,
                       std::shared_ptr<grpc::ChannelCredentials> credentials, std::string user,
                       std::string password)
    : user_(std::move(user)), password_(std::move(password)) {
  endpoints_.reserve(endpoints.size());
  for (const std::string& address : endpoints) {
    EndpointChannel e;
    e.address = address;
    e.channel = MakeChannel(address, credentials);
    e.kv = etcdserverpb::KV::NewStub(e.channel);
    e.lease = etcdserverpb::Lease::NewStub(e.channel);
    e.watch = etcdserverpb::Watch::NewStub(e.channel);
    e.auth = etcdserverpb::Auth::NewStub(e.channel);
    e.maintenance = etcdserverpb::Maintenance::NewStub(e.channel);
    endpoints_.push_back(std::move(e));
  }
}

std::string ChannelSet::token() const {
  MutexLock lock(token_mu_);
  return token_;
}

void ChannelSet::AttachToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("token", token);
}

void ChannelSet::NoteTokenUsed() {
  token_used_ns_.store(SteadyClock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

std::string ChannelSet::TokenForStream(Duration timeout) {
  if (!auth_enabled()) return {};
  const auto used = SteadyClock::time_point(
      SteadyClock::duration(token_used_ns_.load(std::memory_order_relaxed)));
  std::string current = token();
  if (SteadyClock::now() - used > kStreamTokenMaxAge) {
    Status st = Authenticate(current, timeout);
    if (!st.ok()) EFDL_LOG_WARN("{}", st.message());
    current = token();
  }
  return current;
}

Status ChannelSet::Authenticate(const std::string& stale, Duration timeout) {
  if (!auth_enabled()) return Status::OK();
  MutexLock lock(token_mu_);
  if (token_ != stale) return Status::OK();  // another thread got a fresh one meanwhile
  const auto deadline = SteadyClock::now() + timeout;
  std::string errors;
  for (size_t k = 0; k < endpoints_.size(); ++k) {
    EndpointChannel& e = endpoints_[(preferred() + k) % endpoints_.size()];
    etcdserverpb::AuthenticateRequest request;
    request.set_name(user_);
    request.set_password(password_);
    etcdserverpb::AuthenticateResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + (deadline - SteadyClock::now()));
    grpc::Status status = e.auth->Authenticate(&context, request, &response);
    if (status.ok()) {
      token_ = response.token();
      NoteTokenUsed();
      return Status::OK();
    }
    const std::string& msg = status.error_message();
    if (Contains(msg, kAuthFailed)) {
      return Status::InvalidArgument(fmt::format(
          "etcd at {} refused user '{}': wrong user name or password; check --etcd-user and "
          "--etcd-password-file (EFDL_ETCD_USER, EFDL_ETCD_PASSWORD_FILE)",
          e.address, user_));
    }
    if (Contains(msg, kAuthNotEnabled)) {
      // The cluster does not check credentials: carry on without a token, as etcdctl does.
      EFDL_LOG_DEBUG("etcd at {} has auth disabled; user '{}' is not needed", e.address, user_);
      token_.clear();
      NoteTokenUsed();
      return Status::OK();
    }
    if (!errors.empty()) errors += "; ";
    errors += fmt::format("{}: {}", e.address, msg);
    if (!IsRetriableGrpc(status) || SteadyClock::now() >= deadline) {
      Status st = FromGrpc(status, "authenticate", e.address);
      return st.WithContext(fmt::format("cannot authenticate to etcd as '{}'", user_));
    }
  }
  return Status::Unavailable(fmt::format(
      "cannot authenticate to etcd as '{}': no endpoint answered ({})", user_, errors));
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
  if (Contains(msg, kUserEmpty) || Contains(msg, kInvalidToken)) {
    return Status::InvalidArgument(fmt::format(
        "etcd {} refused by {}: etcd requires authentication ({}); give --etcd-user and "
        "--etcd-password-file (EFDL_ETCD_USER, EFDL_ETCD_PASSWORD_FILE)",
        operation, endpoint, msg));
  }
  if (status.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
      Contains(msg, kPermissionDenied)) {
    return Status::FailedPrecondition(fmt::format(
        "etcd {} refused by {}: permission denied; the etcd user needs a role with readwrite "
        "on the job's keys (etcdctl role grant-permission ROLE --prefix=true readwrite "
        "/efdl/JOB/ for this job only, or /efdl/ for every job)",
        operation, endpoint));
  }
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
    case grpc::StatusCode::UNAUTHENTICATED:
      return Status::InvalidArgument(fmt::format(
          "etcd {} refused by {}: not authenticated ({}); check --etcd-user and "
          "--etcd-password-file", operation, endpoint, msg));
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

bool IsStaleTokenGrpc(const grpc::Status& status) {
  const std::string& msg = status.error_message();
  return Contains(msg, kInvalidToken) || Contains(msg, kAuthOldRevision);
}

}  // namespace efdl::etcd
