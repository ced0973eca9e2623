// The control server's tests: a raw worker-side connection to an agent's control socket, as a
// non-Python worker (or any other process of the job's user) would open it, and a fixture that
// runs a ControlServer.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "agent/control_server.h"
#include "common/net.h"

namespace efdl::agent::testing {

// Owns its socket; not thread-safe.

class ControlConn {
 public:
  explicit ControlConn(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~ControlConn() { ::close(fd_); }
  ControlConn(const ControlConn&) = delete;
  ControlConn& operator=(const ControlConn&) = delete;

  bool connected() const { return connected_; }

  // Sends all of `bytes`; false once the server has closed the connection.
  [[nodiscard]] bool Send(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  // `message` as one protocol line.
  [[nodiscard]] bool SendJson(const nlohmann::json& message) { return Send(message.dump() + "\n"); }

  void CloseWrite() { ::shutdown(fd_, SHUT_WR); }

  // The next line (without '\n'); "" at EOF; "<timeout>" when none came within `timeout`.
  std::string ReadLine(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    while (true) {
      size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return "<timeout>";
      char buf[4096];
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return "";
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }
  // The next line as JSON (throws, failing the test, when it is not JSON); null at EOF or when
  // none came within `timeout`.
  nlohmann::json ReadJson(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    std::string line = ReadLine(timeout);
    if (line.empty() || line == "<timeout>") return nullptr;
    return nlohmann::json::parse(line);
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string buffer_;
};

// A ControlServer of job1/node-a at round 3 on a socket in a fresh temporary directory; both are
// gone after the test.
class ControlServerFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("efdl-ctl-test");
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    dir_ = std::move(dir).value();
    auto server = ControlServer::Start({dir_.path() + "/control.sock", "job1", "node-a"});
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    server_->SetRound(3);
  }

  TempDir dir_;   // declared first: destroyed after the server that has its socket in it
  std::unique_ptr<ControlServer> server_;
};

}  // namespace efdl::agent::testing
