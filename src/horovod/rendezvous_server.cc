#include "horovod/rendezvous_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "common/log.h"
#include "horovod/http.h"

namespace efdl::horovod {

namespace {

using Clock = std::chrono::steady_clock;

// How long a connection may take to close after its response before we drop it. Closing with
// unread request bytes would reset the connection and could destroy the response in flight.
constexpr std::chrono::milliseconds kDrainTime{1000};
constexpr size_t kReadChunk = 64 * 1024;

std::string NumericHost(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  std::string out = host;
  // A v4 client of a dual-stack socket shows up as ::ffff:a.b.c.d.
  if (out.rfind("::ffff:", 0) == 0 && out.find('.') != std::string::npos) out = out.substr(7);
  return out;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

bool IsTokenText(std::string_view t) {
  return t.size() >= 32 && t.size() <= 128 &&
         std::all_of(t.begin(), t.end(),
                     [](char ch) { return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'); });
}

// `target` with its first path segment (the token, right or wrong) hidden, for logs.
std::string Redacted(const std::string& target) {
  if (target.empty() || target[0] != '/') return target.substr(0, 128);
  size_t slash = target.find('/', 1);
  std::string rest = slash == std::string::npos ? std::string() : target.substr(slash, 128);
  return "/<token>" + rest;
}

// "/<scope>/<key>" with both parts non-empty and nothing after the key.
bool SplitTarget(const std::string& target, std::string* scope, std::string* key) {
  if (target.size() < 4 || target[0] != '/') return false;
  size_t slash = target.find('/', 1);
  if (slash == std::string::npos || slash == 1 || slash + 1 >= target.size()) return false;
  if (target.find('/', slash + 1) != std::string::npos) return false;
  *scope = target.substr(1, slash - 1);
  *key = target.substr(slash + 1);
  return true;
}

HttpResponse Plain(int status, std::string line) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(line) + "\n";
  return r;
}

}  // namespace

struct RendezvousServer::Connection {
  enum class Phase { kReading, kWriting, kDraining };
  Connection(int f, std::string p, const RendezvousServerOptions& o)
      : fd(f), peer(std::move(p)), parser(o.max_header_bytes, o.max_body_bytes) {}
  int fd;
  std::string peer;
  HttpRequestParser parser;
  Phase phase = Phase::kReading;
  bool got_bytes = false;
  std::string out;
  size_t out_pos = 0;
  Clock::time_point deadline;

  void Close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

Result<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(
    RendezvousServerOptions options, const std::vector<SlotInfo>& round) {
  if (options.bind_addr.empty()) {
    return Status::InvalidArgument(
        "Horovod rendezvous: no bind address given: pass the node's advertise address");
  }
  if (!IsTokenText(options.token)) {
    return Status::InvalidArgument(
        "Horovod rendezvous: no valid token given (32-128 lowercase hex digits): the server "
        "never serves without one; make it with RendezvousToken from the job's secret");
  }
  if (options.request_timeout.count() <= 0 || options.max_connections == 0) {
    return Status::InvalidArgument(
        "Horovod rendezvous: request_timeout and max_connections must be positive");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_str = std::to_string(options.port);
  int rc = ::getaddrinfo(options.bind_addr.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument(fmt::format(
        "Horovod rendezvous: cannot resolve bind address '{}': {}: pass an address of this "
        "machine",
        options.bind_addr, ::gai_strerror(rc)));
  }
  int fd = -1;
  std::string last_error;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                  ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 512) == 0) break;
    last_error = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    return Status::Unavailable(fmt::format(
        "Horovod rendezvous: cannot listen on {}:{}: {}: pick another port or address",
        options.bind_addr, options.port, last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  uint16_t port = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    int e = errno;
    ::close(fd);
    return Status::Internal(fmt::format("Horovod rendezvous: eventfd: {}", std::strerror(e)));
  }
  std::unique_ptr<RendezvousServer> server(
      new RendezvousServer(std::move(options), fd, wake, port, round));
  // Served for every round (the agent cannot tell a Horovod program from another): a detail.
  EFDL_LOG_DEBUG("Horovod rendezvous listening on {}:{} ({} workers in the round)",
                server->address(), port, round.size());
  return server;
}

RendezvousServer::RendezvousServer(RendezvousServerOptions options, int listen_fd, int wake_fd,
                                   uint16_t port, const std::vector<SlotInfo>& round)
    : options_(std::move(options)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      bind_addr_(options_.bind_addr),
      port_(port),
      store_(round),
      thread_([this] { Loop(); }) {}

RendezvousServer::~RendezvousServer() {
  Stop();
  ::close(wake_fd_);
}

void RendezvousServer::Stop() {
  if (!stopping_.exchange(true)) {
    uint64_t one = 1;
    // Cannot fail in a way that matters: a full counter still wakes the loop.
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

RendezvousServer::Stats RendezvousServer::stats() const {
  return Stats{requests_.load(), rejected_.load(), timed_out_.load()};
}

Result<std::string> RendezvousToken(std::string_view job_secret, int64_t round) {
  if (job_secret.empty()) {
    return Status::FailedPrecondition(
        "no job secret: the Horovod rendezvous is served only with a token made from it");
  }
  const std::string message = fmt::format("efdl horovod rendezvous round {}", round);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  if (::HMAC(EVP_sha256(), job_secret.data(), static_cast<int>(job_secret.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
             &mac_len) == nullptr ||
      mac_len < 16) {
    return Status::Internal("Horovod rendezvous: HMAC-SHA256 failed");
  }
  std::string out;
  for (unsigned int i = 0; i < 16; ++i) out += fmt::format("{:02x}", mac[i]);
  return out;
}

std::string HorovodAddrWithToken(const std::string& address, uint16_t port,
                                 const std::string& token) {
  return fmt::format("{}:{}/{}", address, port, token);
}

bool RendezvousServer::Authorized(const Connection& c, std::string* target,
                                  std::string* why) const {
  if (!options_.allowed_clients.empty() &&
      std::find(options_.allowed_clients.begin(), options_.allowed_clients.end(), c.peer) ==
          options_.allowed_clients.end()) {
    *why = fmt::format("client {} is not a member of this round", c.peer);
    return false;
  }
  // "/<token>[:<digits>]/<rest>": the token compared in constant time, the suffix Horovod
  // appends (":<port>") allowed.
  const std::string& t = *target;
  size_t end = t.size() > 1 ? t.find('/', 1) : std::string::npos;
  std::string_view segment =
      end == std::string::npos ? std::string_view() : std::string_view(t).substr(1, end - 1);
  size_t colon = segment.find(':');
  std::string_view given = segment.substr(0, colon);
  bool suffix_ok = colon == std::string_view::npos ||
                   (colon + 1 < segment.size() &&
                    std::all_of(segment.begin() + static_cast<std::ptrdiff_t>(colon) + 1,
                                segment.end(), [](char ch) { return ch >= '0' && ch <= '9'; }));
  if (t.empty() || t[0] != '/' || !suffix_ok || !ConstantTimeEquals(given, options_.token)) {
    *why = "the path does not start with this round's token (HOROVOD_GLOO_RENDEZVOUS_ADDR as "
           "the agent set it carries it)";
    return false;
  }
  *target = t.substr(end);
  return true;
}

void RendezvousServer::Respond(Connection& c) {
  HttpResponse r;
  const HttpRequest& req = c.parser.request();
  std::string why;
  std::string target = req.target;  // without the token once authorized
  bool authorized = false;
  if (c.parser.state() == HttpRequestParser::State::kError) {
    r = Plain(c.parser.error_status(), c.parser.error_message());
  } else if (!Authorized(c, &target, &why)) {
    r = Plain(403, why);
  } else {
    authorized = true;
    std::string scope, key;
    if (req.method != "GET" && req.method != "PUT" && req.method != "DELETE") {
      r = Plain(405, fmt::format("method {} is not served: use GET, PUT or DELETE", req.method));
      r.extra_headers.emplace_back("Allow", "GET, PUT, DELETE");
    } else if (!SplitTarget(target, &scope, &key)) {
      r = Plain(400, fmt::format("path '/<token>{}' is not /<token>/<scope>/<key>",
                                 target.substr(0, 128)));
    } else if (req.method == "GET") {
      auto value = store_.Get(scope, key);
      if (value) {
        r.body = std::move(*value);
      } else {
        r.status = 404;
      }
    } else if (req.method == "PUT") {
      store_.Put(scope, key, std::move(c.parser.request().body));
    } else {
      store_.Delete(scope, key);
    }
  }
  ++requests_;
  // Logs never show a token, right or wrong.
  const std::string shown = authorized ? "/<token>" + target.substr(0, 128) : Redacted(target);
  if (r.status >= 400 && r.status != 404) {
    ++rejected_;
    EFDL_LOG_WARN("Horovod rendezvous: answered {} to {} from {}: {}", r.status,
                  req.method.empty() ? std::string("a malformed request")
                                     : req.method + " " + shown,
                  c.peer, r.body.substr(0, r.body.size() - 1));
  } else {
    EFDL_LOG_DEBUG("Horovod rendezvous: {} {} from {} -> {}", req.method, shown, c.peer,
                   r.status);
  }
  c.out += r.Serialize();
  c.phase = Connection::Phase::kWriting;
  c.deadline = Clock::now() + options_.request_timeout;
  OnWritable(c);
}

void RendezvousServer::OnReadable(Connection& c) {
  char buf[kReadChunk];
  while (c.fd >= 0) {
    ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) c.Close();
      return;
    }
    if (n == 0) {  // the client is gone (or, when draining, done)
      c.Close();
      return;
    }
    if (c.phase != Connection::Phase::kReading) continue;  // discard while draining / writing
    c.got_bytes = true;
    auto state = c.parser.Feed(std::string_view(buf, static_cast<size_t>(n)));
    if (state != HttpRequestParser::State::kIncomplete) {
      Respond(c);
      return;
    }
    if (c.parser.TakeContinueRequest()) {
      c.out += "HTTP/1.1 100 Continue\r\n\r\n";
      OnWritable(c);
    }
  }
}

void RendezvousServer::OnWritable(Connection& c) {
  while (c.fd >= 0 && c.out_pos < c.out.size()) {
    ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) c.Close();
      return;
    }
    c.out_pos += static_cast<size_t>(n);
  }
  if (c.fd < 0 || c.out_pos < c.out.size()) return;
  c.out.clear();
  c.out_pos = 0;
  if (c.phase == Connection::Phase::kWriting) {
    ::shutdown(c.fd, SHUT_WR);
    c.phase = Connection::Phase::kDraining;
    c.deadline = Clock::now() + std::min(kDrainTime, options_.request_timeout);
  }
}

void RendezvousServer::Loop() {
  std::vector<std::unique_ptr<Connection>> conns;
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    bool accepting = conns.size() < options_.max_connections;
    fds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    auto now = Clock::now();
    auto next = Clock::time_point::max();
    for (const auto& c : conns) {
      short ev = c->phase == Connection::Phase::kWriting ? POLLOUT : POLLIN;
      if (c->phase == Connection::Phase::kReading && !c->out.empty()) ev |= POLLOUT;
      fds.push_back({c->fd, ev, 0});
      next = std::min(next, c->deadline);
    }
    int timeout_ms = -1;
    if (next != Clock::time_point::max()) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(ms + 1, 0, 60'000));
    }
    int rc = ::poll(fds.data(), fds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) {
      EFDL_LOG_ERROR("Horovod rendezvous: poll failed: {}; the server stops",
                     std::strerror(errno));
      break;
    }
    if (rc > 0) {
      if (fds[0].revents != 0) {
        uint64_t v;
        [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof(v));
      }
      for (size_t i = 0; i < conns.size(); ++i) {
        short re = fds[i + 2].revents;
        Connection& c = *conns[i];
        if (re == 0 || c.fd < 0) continue;
        if (re & POLLOUT) OnWritable(c);
        if (c.fd >= 0 && (re & (POLLIN | POLLHUP | POLLERR))) OnReadable(c);
      }
      if (fds[1].revents & POLLIN) {
        while (conns.size() < options_.max_connections) {
          sockaddr_storage peer{};
          socklen_t len = sizeof(peer);
          int cfd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len,
                              SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
              EFDL_LOG_WARN("Horovod rendezvous: accept failed: {}", std::strerror(errno));
            }
            break;
          }
          auto c = std::make_unique<Connection>(
              cfd, NumericHost(reinterpret_cast<sockaddr*>(&peer), len), options_);
          c->deadline = Clock::now() + options_.request_timeout;
          conns.push_back(std::move(c));
        }
      }
    }
    now = Clock::now();
    for (auto& c : conns) {
      if (c->fd < 0 || now < c->deadline) continue;
      if (c->phase == Connection::Phase::kReading && c->got_bytes) {
        ++timed_out_;
        c->parser = HttpRequestParser(options_.max_header_bytes, options_.max_body_bytes);
        HttpResponse r = Plain(408, "the request did not arrive in time");
        c->out = r.Serialize();
        c->out_pos = 0;
        c->phase = Connection::Phase::kWriting;
        c->deadline = now + kDrainTime;
        OnWritable(*c);
      } else {
        if (c->phase != Connection::Phase::kDraining) ++timed_out_;
        c->Close();
      }
    }
    std::erase_if(conns, [](const auto& c) { return c->fd < 0; });
  }
  for (auto& c : conns) c->Close();
  // Closed here, not in the destructor, so that nobody can connect to a stopped server.
  ::close(listen_fd_);
}

}  // namespace efdl::horovod
