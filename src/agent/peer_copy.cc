#include "agent/peer_copy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/env_names.h"
#include "common/log.h"
#include "efdl/snapshot.h"
#include "snapshot/arena.h"
#include "snapshot/arena_dir.h"
#include "snapshot/commit_marks.h"
#include "snapshot/hmac.h"
#include "snapshot/scope.h"
#include "snapshot/snapshot_file.h"

namespace efdl::agent {

namespace {

using json = nlohmann::json;
using snapshot::SnapshotArena;

// Version 2: the receiver answers each header before its bytes are sent ("go", or "skip" /
// "old": not sent at all); version 1 sent them at once. Peers of different versions fail the
// handshake ("not a peer-copy port").
constexpr std::string_view kGreeting = "EFDLPC2 ";
constexpr uint32_t kMaxFrame = 1 << 20;                  // a header or a handshake line
constexpr uint64_t kMaxManifest = uint64_t{1} << 30;     // bounds what a peer makes us allocate
constexpr uint64_t kMaxData = uint64_t{1} << 42;         // 4 TiB
constexpr std::chrono::milliseconds kHandshakeTimeout{3000};

void SetTimeout(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

Status WriteAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Status::IOError(fmt::format("send: {}", std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

Status ReadAll(int fd, void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return Status::IOError("the connection was closed");
    if (r < 0) return Status::IOError(fmt::format("recv: {}", std::strerror(errno)));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

Status WriteFrame(int fd, std::string_view text) {
  const uint32_t n = htonl(static_cast<uint32_t>(text.size()));
  EFDL_RETURN_IF_ERROR(WriteAll(fd, &n, sizeof(n)));
  return WriteAll(fd, text.data(), text.size());
}

Result<std::string> ReadFrame(int fd) {
  uint32_t n = 0;
  EFDL_RETURN_IF_ERROR(ReadAll(fd, &n, sizeof(n)));
  n = ntohl(n);
  if (n > kMaxFrame) return Status::IOError(fmt::format("a frame of {} bytes", n));
  std::string text(n, '\0');
  EFDL_RETURN_IF_ERROR(ReadAll(fd, text.data(), n));
  return text;
}

std::string Nonce() {
  uint8_t raw[32];
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t r = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (r > 0) got += static_cast<size_t>(r);
  }
  std::string hex;
  for (uint8_t b : raw) hex += fmt::format("{:02x}", b);
  return hex;
}

// The answer to a challenge: who answers ("client"/"server"), the job, both nonces.
std::string Answer(const std::string& secret, std::string_view who, const std::string& job,
                   const std::string& first, const std::string& second) {
  auto mac = snapshot::HmacSha256Hex(
      secret, fmt::format("efdl peer copy {}\n{}\n{}\n{}", who, job, first, second));
  return mac.ok() ? *mac : std::string();
}

bool SameMac(const std::string& a, const std::string& b) {
  if (a.empty() || a.size() != b.size()) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned>(a[i] ^ b[i]);
  return diff == 0;
}

std::string PeerName(const sockaddr_storage& addr) {
  char host[NI_MAXHOST] = "?";
  char port[NI_MAXSERV] = "?";
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), sizeof(addr), host, sizeof(host), port,
                sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  return fmt::format("{}:{}", host, port);
}

Result<int> Connect(const rdzv::PeerCopyTarget& target, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(target.port);
  if (int rc = ::getaddrinfo(target.addr.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::IOError(fmt::format("cannot resolve {}: {}", target.addr, gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    SetTimeout(fd, timeout);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      ::freeaddrinfo(res);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return Status::IOError(fmt::format("cannot connect to {}:{}: {}", target.addr, target.port,
                                     error));
}

std::string TargetName(const rdzv::PeerCopyTarget& t) {
  return fmt::format("node {} at {}:{}", t.node, t.addr, t.port);
}

// One arena this node writes, as last seen by the sender.
struct Source {
  std::unique_ptr<SnapshotArena> arena;
  ino_t inode = 0;
};

}  // namespace

bool PeerCopyWanted(const std::function<const char*(const char*)>& getenv, bool per_rank,
                    const std::string& secret, std::string* why_not) {
  const char* v = getenv(envvar::kPeerCopy);
  std::string value = v == nullptr ? "" : v;
  value.erase(0, value.find_first_not_of(" \t"));
  value.erase(value.find_last_not_of(" \t") + 1);
  auto no = [&](std::string why) {
    if (why_not != nullptr) *why_not = std::move(why);
    return false;
  };
  if (value == "0") return no(fmt::format("{}=0", envvar::kPeerCopy));
  if (!per_rank) return no("no per-rank snapshots (a node copy is on every node anyway)");
  if (secret.empty()) return no("no job secret to authenticate the peers with");
  return true;
}

Result<std::unique_ptr<PeerCopy>> PeerCopy::Start(PeerCopyOptions options) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST;
  addrinfo* res = nullptr;
  const char* host = options.listen_addr.empty() ? nullptr : options.listen_addr.c_str();
  if (int rc = ::getaddrinfo(host, "0", &hints, &res); rc != 0) {
    return Status::IOError(fmt::format("peer copy: cannot listen on '{}': {}",
                                       options.listen_addr, gai_strerror(rc)));
  }
  const int fd = ::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 8) != 0) {
    const std::string err = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    ::freeaddrinfo(res);
    return Status::IOError(fmt::format("peer copy: cannot listen on '{}': {}",
                                       options.listen_addr, err));
  }
  ::freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const uint16_t port = ntohs(bound.ss_family == AF_INET6
                                  ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                  : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<PeerCopy> pc(new PeerCopy(std::move(options), fd, port));
  if (::pipe2(pc->wake_, O_CLOEXEC) != 0) {
    return Status::IOError(fmt::format("peer copy: pipe: {}", std::strerror(errno)));
  }
  pc->receiver_ = std::thread([p = pc.get()] { p->ReceiveLoop(); });
  pc->sender_ = std::thread([p = pc.get()] { p->SendLoop(); });
  return pc;
}

PeerCopy::PeerCopy(PeerCopyOptions options, int listen_fd, uint16_t port)
    : options_(std::move(options)), listen_fd_(listen_fd), port_(port) {}

PeerCopy::~PeerCopy() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (wake_[1] >= 0) {
    const char b = 1;
    (void)!::write(wake_[1], &b, 1);
  }
  if (int fd = serving_fd_.load(); fd >= 0) ::shutdown(fd, SHUT_RDWR);
  if (int fd = sending_fd_.load(); fd >= 0) ::shutdown(fd, SHUT_RDWR);
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
  ::close(listen_fd_);
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
}

void PeerCopy::SetRound(int64_t round, int rank_offset, int nproc, rdzv::PeerCopyTarget target) {
  {
    MutexLock lock(mu_);
    round_ = round;
    round_start_ = std::chrono::duration<double>(
                       std::chrono::system_clock::now().time_since_epoch()).count();
    rank_offset_ = rank_offset;
    nproc_ = nproc;
    target_ = std::move(target);
  }
  cv_.notify_all();
}

void PeerCopy::StopSending() {
  MutexLock lock(mu_);
  nproc_ = 0;
  target_ = {};
}

PeerCopy::Counts PeerCopy::counts() const {
  MutexLock lock(mu_);
  return counts_;
}

void PeerCopy::SendLoop() {
  std::map<std::string, Source> sources;          // arena path -> its mapping
  std::map<std::string, uint64_t> sent;           // scope -> seq sent to `sent_to`
  rdzv::PeerCopyTarget sent_to;
  std::string failing;                            // the last failure logged (logged once)
  // The back-off after failed passes (PeerCopyOptions::retry_max): no try before retry_at.
  snapshot::MarkClock::time_point retry_at{};
  std::chrono::milliseconds retry_delay{0};
  // The mark rule (snapshot/commit_marks.h) per arena: only the newest ready mark is sent, the
  // same commits the other nodes store and copy.
  std::map<std::string, snapshot::CommitMarks> marks;   // scope -> its measurements
  // The send buffer: one rank's snapshot at a time, kept between passes (a fresh one per pass
  // was allocated, zero-filled and faulted in at every transfer).
  std::vector<uint8_t> buf;
  for (;;) {
    auto delay = snapshot::MarkClock::duration(options_.poll_interval);
    for (const auto& [scope, m] : marks) {
      delay = std::min(delay, m.PollDelay(snapshot::MarkClock::now(), options_.poll_interval));
    }
    int64_t round = 0;
    double round_start = 0;
    int offset = 0;
    int nproc = 0;
    rdzv::PeerCopyTarget target;
    {
      MutexLock lock(mu_);
      cv_.wait_for(lock, delay, [&]() EFDL_REQUIRES(mu_) { return stop_; });
      if (stop_) return;
      round = round_;
      round_start = round_start_;
      offset = rank_offset_;
      nproc = nproc_;
      target = target_;
    }
    if (target.port == 0 || nproc <= 0) continue;
    if (!(target == sent_to)) {
      sent.clear();
      sent_to = target;
      retry_at = {};
      retry_delay = std::chrono::milliseconds(0);
    }
    // The newest ready mark of each arena this node writes, where it is newer than what the
    // target has.
    struct Pending {
      std::string scope;
      SnapshotArena* arena;
      snapshot::SlotInfo slot;
    };
    std::vector<Pending> pending;
    std::vector<int> ranks;
    for (int r = offset; r < offset + nproc; ++r) {
      ranks.push_back(r);
      const std::string scope = snapshot::ScopeName(true, r);
      const std::string path =
          snapshot::ArenaPath(options_.shm_dir, options_.job_id, options_.holder, scope);
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) continue;
      Source& src = sources[path];
      if (!src.arena || src.inode != st.st_ino) {
        auto opened = SnapshotArena::Open(path);
        if (!opened.ok()) continue;
        src.arena = std::move(opened).value();
        src.inode = src.arena->inode();
      }
      auto slots = src.arena->ReadySlots();
      if (slots.empty()) continue;
      const auto now = snapshot::MarkClock::now();
      auto& m = marks.try_emplace(scope, options_.min_interval).first->second;
      m.Observe(slots.front().seq, now);
      const uint64_t stride = m.Stride(now);
      auto mark = std::find_if(slots.begin(), slots.end(), [&](const snapshot::SlotInfo& s) {
        return snapshot::IsMark(s.seq, stride);
      });
      if (mark == slots.end()) continue;   // a mark missed (overwritten) is skipped
      auto it = sent.find(scope);
      if (it != sent.end() && it->second >= mark->seq) continue;
      // Only a commit of this round: an arena of the same rank left by an earlier round holds
      // another layout's shard, and its copy would make the successor drop the copies of its
      // previous predecessor before this round's recovery has read them.
      const snapshot::SlotInfo& newest = *mark;
      auto head = snapshot::Manifest::Parse(std::string_view(
          reinterpret_cast<const char*>(src.arena->manifest_area(newest.slot)),
          newest.manifest_len));
      if (!src.arena->Unchanged(newest.slot, newest.seq) || !head.ok() ||
          head->wall_time < round_start) {
        continue;
      }
      pending.push_back({scope, src.arena.get(), newest});
    }
    if (pending.empty() || snapshot::MarkClock::now() < retry_at) continue;
    auto fd = Connect(target, options_.io_timeout);
    Status st = fd.status();
    if (fd.ok()) {
      sending_fd_.store(*fd);
      st = [&]() -> Status {
        SetTimeout(*fd, kHandshakeTimeout);
        EFDL_ASSIGN_OR_RETURN(std::string hello, ReadFrame(*fd));
        if (!hello.starts_with(kGreeting)) return Status::IOError("not a peer-copy port");
        const std::string nonce_s = hello.substr(kGreeting.size());
        const std::string nonce_c = Nonce();
        EFDL_RETURN_IF_ERROR(WriteFrame(
            *fd, nonce_c + Answer(options_.secret, "client", options_.job_id, nonce_s, nonce_c)));
        EFDL_ASSIGN_OR_RETURN(std::string answer, ReadFrame(*fd));
        if (!SameMac(answer,
                     Answer(options_.secret, "server", options_.job_id, nonce_c, nonce_s))) {
          return Status::FailedPrecondition(
              "it refused this node's answer or gave a wrong one to the job secret's challenge");
        }
        SetTimeout(*fd, options_.io_timeout);
        for (const Pending& p : pending) {
          // Read the slot at memory speed, then the seqlock: a commit that took it meanwhile
          // makes the copy torn, which is never sent.
          buf.resize(p.slot.manifest_len + p.slot.data_len);
          std::memcpy(buf.data(), p.arena->manifest_area(p.slot.slot), p.slot.manifest_len);
          std::memcpy(buf.data() + p.slot.manifest_len, p.arena->data_area(p.slot.slot),
                      p.slot.data_len);
          std::optional<uint64_t> checksum = p.arena->Checksum(p.slot.slot, p.slot.seq);
          if (!p.arena->Unchanged(p.slot.slot, p.slot.seq)) {
            MutexLock lock(mu_);
            ++counts_.torn;
            continue;
          }
          auto manifest = snapshot::Manifest::Parse(std::string_view(
              reinterpret_cast<const char*>(buf.data()), p.slot.manifest_len));
          if (!manifest.ok() || manifest->data_bytes != p.slot.data_len) continue;
          if (!checksum) {
            checksum = snapshot::ChecksumOfRegion(manifest->tensors,
                                                  buf.data() + p.slot.manifest_len, nullptr);
          }
          json head = {{"scope", p.scope},   {"seq", p.slot.seq},
                       {"step", p.slot.step}, {"ml", p.slot.manifest_len},
                       {"dl", p.slot.data_len}, {"ck", *checksum},
                       {"round", round},     {"ranks", ranks}};
          EFDL_RETURN_IF_ERROR(WriteFrame(*fd, head.dump()));
          // The receiver answers the header: "go" (then the bytes, and "ok" once installed),
          // "skip" (no room there: logged there) or "old" (a newer round's predecessor sends
          // there), both before any byte is sent. Not sent again until a newer snapshot.
          EFDL_ASSIGN_OR_RETURN(std::string reply, ReadFrame(*fd));
          if (reply == "go") {
            EFDL_RETURN_IF_ERROR(WriteAll(*fd, buf.data(), buf.size()));
            {
              MutexLock lock(mu_);
              counts_.bytes_sent += buf.size();
            }
            EFDL_ASSIGN_OR_RETURN(reply, ReadFrame(*fd));
          }
          sent[p.scope] = p.slot.seq;
          if (reply == "ok") {
            MutexLock lock(mu_);
            ++counts_.sent;
          }
        }
        return Status::OK();
      }();
      sending_fd_.store(-1);
      ::close(*fd);
    }
    if (!st.ok()) {
      const std::string line = fmt::format("peer copy to {}: {}", TargetName(target), st.message());
      if (line != failing) {
        EFDL_LOG_WARN("{}; trying again with a back-off of up to {:.1f} s", line,
                      std::chrono::duration<double>(options_.retry_max).count());
      }
      failing = line;
      retry_delay = retry_delay.count() == 0
                        ? options_.poll_interval
                        : std::min<std::chrono::milliseconds>(2 * retry_delay, options_.retry_max);
      retry_at = snapshot::MarkClock::now() + retry_delay;
      MutexLock lock(mu_);
      ++counts_.failed;
    } else {
      failing.clear();
      retry_at = {};
      retry_delay = std::chrono::milliseconds(0);
    }
  }
}

void PeerCopy::ReceiveLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    {
      MutexLock lock(mu_);
      if (stop_) return;
    }
    if (!(fds[0].revents & POLLIN)) continue;
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // Its answers are small frames written as two sends, each awaited by the sender: without
    // this, Nagle holds the second one until the delayed ACK of the first (up to 40 ms).
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    serving_fd_.store(fd);
    {
      MutexLock lock(mu_);
      if (stop_) ::shutdown(fd, SHUT_RDWR);
    }
    SetTimeout(fd, kHandshakeTimeout);
    const std::string nonce_s = Nonce();
    Status st = WriteFrame(fd, std::string(kGreeting) + nonce_s);
    auto answer = st.ok() ? ReadFrame(fd) : Result<std::string>(st);
    const std::string who = PeerName(from);
    if (answer.ok() && answer->size() == 128 &&
        SameMac(answer->substr(64), Answer(options_.secret, "client", options_.job_id, nonce_s,
                                           answer->substr(0, 64)))) {
      st = WriteFrame(fd, Answer(options_.secret, "server", options_.job_id,
                                 answer->substr(0, 64), nonce_s));
      if (st.ok()) {
        SetTimeout(fd, options_.io_timeout);
        Serve(fd);
      }
    } else {
      EFDL_LOG_WARN("peer copy: refused a connection from {}: it did not answer the job secret's "
                    "challenge", who);
      MutexLock lock(mu_);
      ++counts_.refused;
    }
    serving_fd_.store(-1);
    ::close(fd);
  }
}

void PeerCopy::Serve(int fd) {
  for (;;) {
    auto text = ReadFrame(fd);
    if (!text.ok()) return;   // the sender is done (or cut: its slot is abandoned below)
    json head = json::parse(*text, nullptr, false);
    if (!head.is_object() || !head["scope"].is_string() || !head["seq"].is_number_unsigned() ||
        !head["step"].is_number_integer() || !head["ml"].is_number_unsigned() ||
        !head["dl"].is_number_unsigned() || !head["ck"].is_number_unsigned() ||
        !head["round"].is_number_integer() || !head["ranks"].is_array()) {
      return;
    }
    const std::string scope = head["scope"];
    const auto seq = head["seq"].get<uint64_t>();
    const auto step = head["step"].get<int64_t>();
    const auto ml = head["ml"].get<uint64_t>();
    const auto dl = head["dl"].get<uint64_t>();
    const auto ck = head["ck"].get<uint64_t>();
    const auto round = head["round"].get<int64_t>();
    const std::string peer_scope = snapshot::PeerArenaScope(scope);
    if (!snapshot::PeerSourceScope(peer_scope) || ml > kMaxManifest || dl > kMaxData ||
        seq == 0) {
      return;
    }
    std::set<std::string> keep;
    for (const auto& r : head["ranks"]) {
      if (!r.is_number_integer()) return;
      keep.insert(snapshot::PeerArenaScope(snapshot::ScopeName(true, r.get<int>())));
    }
    const std::string path =
        snapshot::ArenaPath(options_.shm_dir, options_.job_id, options_.holder, peer_scope);
    {
      MutexLock lock(mu_);
      if (stop_) return;
    }
    if (round < newest_round_) {
      // An earlier round's predecessor still sending: the current one's copies stay.
      if (!WriteFrame(fd, "old").ok()) return;
      continue;
    }
    newest_round_ = round;
    // The peer arena: the existing one when the snapshot fits, else a new one, installed once it
    // holds this snapshot (the previous copy stays until then).
    // Kept mapped between transfers (made writable once: PrefaultForWrite writes every page).
    std::unique_ptr<SnapshotArena>& kept = peer_arenas_[path];
    struct stat file {};
    if (kept && (::stat(path.c_str(), &file) != 0 || file.st_ino != kept->inode())) kept.reset();
    if (!kept) {
      if (auto opened = SnapshotArena::Open(path); opened.ok()) {
        kept = std::move(opened).value();
        kept->PrefaultForWrite();
      }
    }
    SnapshotArena* arena = nullptr;
    std::unique_ptr<SnapshotArena> fresh;
    if (kept && kept->num_slots() == options_.peer_slots && kept->manifest_capacity() >= ml &&
        kept->data_capacity() >= dl) {
      arena = kept.get();
    } else {
      auto created = SnapshotArena::Create(path, options_.peer_slots, ml * 2 + (uint64_t{64} << 10),
                                           dl);
      if (!created.ok()) {
        // One line per scope, until a copy of it is kept again (each transfer is a connection
        // of its own, about one per EFDL_PERSIST_MIN_INTERVAL_MS).
        if (skipping_.insert(scope).second) {
          EFDL_LOG_WARN("peer copy: not keeping the copy of {} (snapshot seq {}): {}; the job "
                        "goes on without it (logged once)", scope, seq,
                        created.status().message());
        }
        {
          MutexLock lock(mu_);
          ++counts_.skipped;
        }
        if (!WriteFrame(fd, "skip").ok()) return;   // nothing of it was sent
        continue;
      }
      fresh = std::move(created).value();
      arena = fresh.get();
    }
    auto slot = arena->BeginWrite(std::chrono::milliseconds(0));
    if (!slot.ok()) return;
    Status st = WriteFrame(fd, "go");
    if (st.ok()) st = ReadAll(fd, arena->manifest_area(*slot), ml);
    if (st.ok()) st = ReadAll(fd, arena->data_area(*slot), dl);
    if (st.ok()) {
      auto manifest = snapshot::Manifest::Parse(
          std::string_view(reinterpret_cast<const char*>(arena->manifest_area(*slot)), ml));
      if (!manifest.ok() || manifest->data_bytes != dl || manifest->seq != seq ||
          manifest->scope != scope ||
          snapshot::ChecksumOfRegion(manifest->tensors, arena->data_area(*slot), nullptr) != ck) {
        st = Status::Corruption(fmt::format("the copy of {} (snapshot seq {}) fails its checksum",
                                            scope, seq));
        EFDL_LOG_WARN("peer copy: {}; dropped", st.message());
      }
    }
    if (!st.ok()) {
      // Cut midway (or damaged): the slot goes back, the previous complete copy stays.
      arena->Abandon(*slot);
      return;
    }
    arena->Publish(*slot, seq, step, ml, dl);
    arena->SetChecksum(*slot, seq, ck);
    if (fresh) {
      if (!fresh->Install().ok()) return;
      kept = std::move(fresh);
    }
    {
      MutexLock lock(mu_);
      ++counts_.received;
    }
    skipping_.erase(scope);
    // The copies this node keeps: its predecessor's current ranks; an earlier predecessor's
    // go once the current one's copies of this round arrive.
    {
      const std::string job = snapshot::SafeName(options_.job_id);
      std::error_code dir_ec;
      for (const auto& e : std::filesystem::directory_iterator(options_.shm_dir, dir_ec)) {
        auto name = snapshot::ParseArenaFileName(e.path().filename().string());
        if (!name || name->job != job || name->holder != options_.holder ||
            !snapshot::PeerSourceScope(name->scope) || keep.count(name->scope)) {
          continue;
        }
        peer_arenas_.erase(e.path().string());
        std::error_code ec;
        std::filesystem::remove(e.path(), ec);
      }
    }
    if (!WriteFrame(fd, "ok").ok()) return;
  }
}

}  // namespace efdl::agent
