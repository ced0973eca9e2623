// Fuzzes the agent's control socket end to end: each input is what one worker connection sends
// (split into a few writes), against one real ControlServer on a unix socket. The first input
// byte sets the server's current round, so hellos of the current round are reached too.
// Properties: no crash or sanitizer report in the server thread; every connection ends (the
// server closes it on EOF or on an oversized line), which also shows the serving thread is alive.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "agent/control_server.h"
#include "agent/round_reports.h"
#include "common/net.h"

namespace {

using efdl::agent::ControlChannel;
using efdl::agent::ControlServer;

// The server under test and its directory; built on first use, destroyed (thread joined, socket
// removed) when the fuzzer exits.
struct Fixture {
  Fixture() {
    auto dir_or = efdl::TempDir::Create("efdl-fuzz");
    if (!dir_or.ok()) std::abort();
    dir = std::move(dir_or).value();
    auto started = ControlServer::Start({dir.path() + "/control.sock", "fuzzjob", "fuzznode"});
    if (!started.ok()) std::abort();
    server = std::move(started).value();
    channel = std::make_unique<ControlChannel>(*server);
  }
  efdl::TempDir dir;
  std::unique_ptr<ControlServer> server;
  // The agent's books of the server's reports (round_reports.h); declared after the server.
  std::unique_ptr<ControlChannel> channel;
};

int Connect(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (fd < 0) std::abort();
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) std::abort();
  return fd;
}

// libFuzzer's -timeout runs on SIGALRM, which interrupts whatever blocking call this thread is
// in (EINTR): every call below retries then, so only the server's behaviour can fail the run.
void SendAll(int fd, std::string_view piece) {
  while (!piece.empty()) {
    ssize_t n = ::send(fd, piece.data(), piece.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the server closed the connection (an oversized line): allowed
    piece.remove_prefix(static_cast<size_t>(n));
  }
}

// Reads until the server closes the connection; false if it does not within 10 s.
bool DrainUntilClosed(int fd) {
  char buf[4096];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    int ready = ::poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready != 1) return false;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fixture;
  if (size == 0) return 0;
  const int64_t round = data[0] % 4;
  fixture.server->SetRound(round);
  std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);

  int fd = Connect(fixture.server->path());
  // Three writes at input-dependent places: lines split across reads are part of the contract.
  size_t cut1 = input.size() / 3, cut2 = 2 * input.size() / 3;
  for (auto piece : {input.substr(0, cut1), input.substr(cut1, cut2 - cut1), input.substr(cut2)}) {
    SendAll(fd, piece);
  }
  fixture.server->RequestStop(round, true, "fuzz");
  (void)fixture.server->IsConnected(round, 0);
  (void)fixture.channel->StoppingRanks(round);   // takes the reports in
  (void)fixture.server->newest_step();
  ::shutdown(fd, SHUT_WR);
  if (!DrainUntilClosed(fd)) std::abort();
  ::close(fd);
  return 0;
}
