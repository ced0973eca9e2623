#include "agent/control_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agent/control_messages.h"
#include "common/env_names.h"
#include "snapshot/scope.h"
#include "common/log.h"

namespace efdl::agent {

namespace {

using nlohmann::json;

constexpr size_t kMaxLine = 64 * 1024;
// Flush requests waiting for the agent's loop; a worker cannot have more than one in flight, so
// more than this means something is sending them without waiting for the answers.
constexpr size_t kMaxPendingFlushes = 256;
// The longest a flush may take (the agent's own final persist allows as much).
constexpr int64_t kMaxFlushTimeoutMs = 10 * 60 * 1000;

// Field readers that never throw: a malformed field reads as the fallback.
int64_t IntField(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return fallback;
  return it->get<int64_t>();
}
std::string StringField(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return {};
  return it->get<std::string>();
}
bool BoolField(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_boolean()) return fallback;
  return it->get<bool>();
}

WorkerReport ReportOf(WorkerReport::Kind kind, int64_t step = -1) {
  WorkerReport r;
  r.kind = kind;
  r.step = step;
  return r;
}

std::string Line(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace

Result<std::unique_ptr<ControlServer>> ControlServer::Start(ControlServerOptions options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(fmt::format(
        "control socket path '{}' is empty or longer than {} bytes; set TMPDIR to a shorter "
        "directory", options.socket_path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, options.socket_path.c_str(), options.socket_path.size() + 1);

  std::unique_ptr<ControlServer> server(new ControlServer(std::move(options)));
  const std::string& path = server->options_.socket_path;
  server->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (server->listen_fd_ < 0) {
    return Status::Internal(fmt::format("socket(AF_UNIX): {}", std::strerror(errno)));
  }
  // The umask makes the socket 0600 from its creation: no window where others could connect.
  mode_t old_mask = ::umask(0077);
  int rc = ::bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old_mask);
  if (rc != 0) {
    return Status::IOError(fmt::format("cannot create the control socket {}: {}", path,
                                       std::strerror(bind_errno)));
  }
  ::chmod(path.c_str(), 0600);
  if (::listen(server->listen_fd_, 64) != 0) {
    return Status::IOError(fmt::format("listen on {}: {}", path, std::strerror(errno)));
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return Status::Internal(fmt::format("pipe: {}", std::strerror(errno)));
  }
  server->wake_read_ = wake[0];
  server->wake_write_ = wake[1];
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

ControlServer::~ControlServer() {
  if (thread_.joinable()) {
    char byte = 0;
    ssize_t ignored = ::write(wake_write_, &byte, 1);
    (void)ignored;
    thread_.join();
  }
  for (auto& [fd, client] : clients_) ::close(fd);
  for (int fd : {listen_fd_, wake_read_, wake_write_}) {
    if (fd >= 0) ::close(fd);
  }
  if (listen_fd_ >= 0) ::unlink(options_.socket_path.c_str());
}

void ControlServer::SetRound(int64_t round) {
  MutexLock lock(mutex_);
  round_ = round;
}

bool ControlServer::IsConnected(int64_t round, int local_rank) const {
  MutexLock lock(mutex_);
  for (const auto& [fd, c] : clients_) {
    if (c.said_hello && c.round == round && c.local_rank == local_rank) return true;
  }
  return false;
}

std::vector<int> ControlServer::RequestStop(int64_t round, bool graceful,
                                            const std::string& reason) {
  return SendToRound(control::kStop, round, graceful, reason, /*in_process_only=*/false);
}

std::vector<int> ControlServer::SendToRound(const char* type, int64_t round, bool graceful,
                                            const std::string& reason, bool in_process_only) {
  std::string line = Line({{"type", type}, {"round", round}, {"graceful", graceful},
                           {"reason", reason}});
  MutexLock lock(mutex_);
  std::vector<int> reached;
  for (const auto& [fd, c] : clients_) {
    if (!c.said_hello || c.round != round || (in_process_only && !c.in_process)) continue;
    SendLocked(fd, line);
    reached.push_back(c.local_rank);
  }
  return reached;
}

std::vector<int> ControlServer::InProcessRanks(int64_t round) const {
  MutexLock lock(mutex_);
  std::vector<int> out;
  for (const auto& [fd, c] : clients_) {
    if (c.said_hello && c.in_process && c.round == round) out.push_back(c.local_rank);
  }
  return out;
}

std::vector<int> ControlServer::RequestPause(int64_t round, bool graceful,
                                             const std::string& reason) {
  return SendToRound(control::kPause, round, graceful, reason, /*in_process_only=*/true);
}

bool ControlServer::AssignRound(int64_t round, int local_rank, int64_t new_round, int new_rank,
                                const std::map<std::string, std::string>& env) {
  // The place itself as typed fields; `env` is what a worker started for it would get.
  std::string line = Line({{"type", control::kRound}, {"round", new_round}, {"rank", new_rank},
                           {"local_rank", local_rank}, {"env", env}});
  MutexLock lock(mutex_);
  for (auto& [fd, c] : clients_) {
    if (!c.said_hello || !c.in_process || c.round != round || c.local_rank != local_rank) {
      continue;
    }
    SendLocked(fd, line);
    c.round = new_round;
    c.rank = new_rank;
    return true;
  }
  return false;
}

std::vector<WorkerReport> ControlServer::TakeReports() {
  MutexLock lock(mutex_);
  std::vector<WorkerReport> out;
  out.swap(reports_);
  return out;
}

void ControlServer::Report(const Client& client, WorkerReport report) {
  if (reports_.size() >= kMaxReports) {
    if (!reports_dropped_) {
      EFDL_LOG_WARN("control socket: {} worker reports wait for the agent; dropping more",
                    reports_.size());
    }
    reports_dropped_ = true;
    return;
  }
  report.round = client.round;
  report.rank = client.rank;
  report.local_rank = client.local_rank;
  reports_.push_back(std::move(report));
}

std::optional<int64_t> ControlServer::newest_step() const {
  MutexLock lock(mutex_);
  return newest_step_;
}

std::vector<FlushRequest> ControlServer::TakeFlushRequests() {
  MutexLock lock(mutex_);
  std::vector<FlushRequest> out;
  out.swap(flushes_);
  return out;
}

void ControlServer::AnswerFlush(const FlushRequest& request, const Status& status,
                                bool persisted) {
  json id = json::parse(request.id_json, nullptr, /*allow_exceptions=*/false);
  if (id.is_discarded()) id = nullptr;
  std::string line = status.ok()
                         ? Line({{"type", control::kReply}, {"id", id}, {"persisted", persisted}})
                         : Line({{"type", control::kError}, {"id", id},
                                 {"message", status.message()}});
  MutexLock lock(mutex_);
  for (const auto& [fd, c] : clients_) {
    if (c.connection == request.connection) {
      SendLocked(fd, line);
      return;
    }
  }
}

void ControlServer::SendLocked(int fd, const std::string& json_line) {
  // Messages are tiny and rare: a full socket buffer means the worker stopped reading, and
  // dropping the message is then better than blocking every caller. The escalation to signals
  // covers a worker that never reads its stop request.
  ssize_t n = ::send(fd, json_line.data(), json_line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(json_line.size())) {
    EFDL_LOG_WARN("control socket: could not send to a worker (fd {}): {}", fd,
                  n < 0 ? std::strerror(errno) : "short write");
  }
}

bool ControlServer::HandleLine(int fd, Client& client, const std::string& line) {
  json msg = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (msg.is_discarded() || !msg.is_object()) {
    SendLocked(fd, Line({{"type", control::kError}, {"message", "not a JSON object"}}));
    return true;
  }
  const std::string type = StringField(msg, "type");
  if (type == control::kHello) {
    client.said_hello = true;
    client.pid = static_cast<int>(IntField(msg, "pid", 0));
    client.rank = static_cast<int>(IntField(msg, "rank", -1));
    client.local_rank = static_cast<int>(IntField(msg, "local_rank", -1));
    client.round = IntField(msg, "round", -1);
    if (client.round != round_) {
      SendLocked(fd, Line({{"type", control::kStop}, {"round", client.round}, {"graceful", false},
                           {"reason", fmt::format("round {} is over", client.round)}}));
    } else {
      SendLocked(fd, Line({{"type", control::kWelcome}, {"version", control::kProtocolVersion},
                           {"round", round_}, {"job_id", options_.job_id},
                           {"node_id", options_.node_id}}));
    }
    EFDL_LOG_DEBUG("control socket: hello from rank {} (local {}, pid {}, round {})",
                   client.rank, client.local_rank, client.pid, client.round);
    return true;
  }
  if (type == control::kCommitted || type == control::kStopping) {
    int64_t step = IntField(msg, "step", -1);
    if (step >= 0 && (!newest_step_ || step > *newest_step_)) newest_step_ = step;
    if (type == control::kStopping) {
      // A worker that does not say (an older efdl) may hold GPU memory: not released early.
      const bool gpu = BoolField(msg, "gpu", false);
      if (client.said_hello) {
        WorkerReport r = ReportOf(WorkerReport::Kind::kStopping, step);
        r.released = msg.contains("gpu") && !gpu;
        Report(client, std::move(r));
      }
      EFDL_LOG_INFO("rank {} stopping after step {} (snapshot: {}{})", client.rank, step,
                    BoolField(msg, "snapshot", false), gpu ? "; it used a GPU" : "");
    }
    return true;
  }
  if (type == control::kInProcess) {
    if (client.said_hello) client.in_process = true;
    // The answer tells the worker it is counted: a round's close from now on pauses it.
    SendLocked(fd, Line({{"type", control::kInProcess}, {"round", client.round},
                         {"accepted", client.said_hello}}));
    EFDL_LOG_DEBUG("control socket: rank {} (pid {}) takes round changes in-process",
                   client.rank, client.pid);
    return true;
  }
  // A worker speaks for its own round only (the one it said hello for, or was assigned): the
  // message's "round" is not trusted, so nothing here grows with made-up rounds.
  if (type == control::kFailed || type == control::kRaised) {
    if (client.said_hello) {
      WorkerReport r = ReportOf(type == control::kRaised ? WorkerReport::Kind::kRaised
                                                         : WorkerReport::Kind::kFailed);
      r.message = StringField(msg, "message");
      Report(client, std::move(r));
    }
    return true;
  }
  if (type == control::kReturned) {
    if (client.said_hello) Report(client, ReportOf(WorkerReport::Kind::kReturned));
    return true;
  }
  if (type == control::kPaused) {
    const int64_t round = client.round;
    const int64_t step = IntField(msg, "step", -1);
    if (step >= 0 && (!newest_step_ || step > *newest_step_)) newest_step_ = step;
    if (client.said_hello) Report(client, ReportOf(WorkerReport::Kind::kPaused, step));
    // "step": the State's step of this rank's newest commit (its "step" value, else the job's
    // commit count, python/efdl/state.py); the next round says the snapshot step it continues at.
    EFDL_LOG_INFO("rank {} paused in round {} after its commit of step {} ({})", client.rank,
                  round, step,
                  BoolField(msg, "snapshot", false) ? "snapshot taken"
                                                    : "going back to its newest snapshot");
    return true;
  }
  if (type == control::kPersisted) {
    Report(client, ReportOf(WorkerReport::Kind::kPersisted, IntField(msg, "step", -1)));
    return true;
  }
  json reply_id = msg.contains("id") ? msg["id"] : json(nullptr);
  if (type == control::kFlush) {
    std::string scope = StringField(msg, "scope");
    const bool scope_ok = snapshot::ValidScope(scope);
    std::string problem;
    if (!client.said_hello) {
      problem = "say hello before asking for a flush";
    } else if (!scope_ok) {
      problem = fmt::format("flush needs a scope \"node\" or \"rank<N>\", got '{}'", scope);
    } else if (flushes_.size() >= kMaxPendingFlushes) {
      problem = "too many flush requests waiting; wait for the answers";
    }
    if (!problem.empty()) {
      SendLocked(fd, Line({{"type", control::kError}, {"id", reply_id}, {"message", problem}}));
      return true;
    }
    const int64_t timeout_ms =
        std::clamp<int64_t>(IntField(msg, "timeout_ms", kMaxFlushTimeoutMs), 0, kMaxFlushTimeoutMs);
    flushes_.push_back({client.connection, reply_id.dump(), std::move(scope), client.local_rank,
                        std::chrono::milliseconds(timeout_ms)});
    return true;
  }
  if (type == control::kQuery && StringField(msg, "what") == control::kQueryRestore) {
    json step = newest_step_ ? json(*newest_step_) : json(nullptr);
    SendLocked(fd, Line({{"type", control::kReply}, {"id", reply_id}, {"restore_step", step},
                         {"round", round_}}));
    return true;
  }
  SendLocked(fd, Line({{"type", control::kError}, {"id", reply_id},
                       {"message", fmt::format("unknown request type '{}'", type)}}));
  return true;
}

void ControlServer::Serve() {
  std::vector<pollfd> fds;
  char buf[4096];
  while (true) {
    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    {
      MutexLock lock(mutex_);
      for (const auto& [fd, c] : clients_) fds.push_back({fd, POLLIN, 0});
    }
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      EFDL_LOG_ERROR("control socket: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) {
      while (true) {
        int cfd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (cfd < 0) break;
        MutexLock lock(mutex_);
        Client client;
        client.connection = next_connection_++;
        clients_.emplace(cfd, std::move(client));
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      int fd = fds[i].fd;
      bool keep = true;
      bool eof = false;
      MutexLock lock(mutex_);
      auto it = clients_.find(fd);
      if (it == clients_.end()) continue;
      Client& client = it->second;
      // At most about kMaxLine bytes per wake-up: a client that writes without pause cannot
      // keep this thread here or grow the buffer without bound; poll reports the rest.
      size_t taken = 0;
      while (taken <= kMaxLine) {
        ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
        if (r > 0) {
          client.buffer.append(buf, static_cast<size_t>(r));
          taken += static_cast<size_t>(r);
          continue;
        }
        if (r < 0 && errno == EINTR) continue;
        eof = !(r < 0 && errno == EAGAIN);  // EOF or an error: lines already read still count
        break;
      }
      size_t nl;
      while (keep && (nl = client.buffer.find('\n')) != std::string::npos) {
        std::string line = client.buffer.substr(0, nl);
        client.buffer.erase(0, nl + 1);
        if (!line.empty()) keep = HandleLine(fd, client, line);
      }
      if (client.buffer.size() > kMaxLine) {
        EFDL_LOG_WARN("control socket: closing a connection that sent a line over {} bytes",
                      kMaxLine);
        SendLocked(fd, Line({{"type", control::kError},
                             {"message", fmt::format("line longer than {} bytes; closing the "
                                                     "connection", kMaxLine)}}));
        keep = false;
      }
      if (!keep || eof) {
        ::close(fd);
        clients_.erase(it);
      }
    }
  }
}

}  // namespace efdl::agent
