#include "agent/control_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/net.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

using nlohmann::json;
using testing::WaitUntil;

// A raw worker-side connection: what a non-Python worker would do.
class RawClient {
 public:
  explicit RawClient(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawClient() { ::close(fd_); }
  bool connected() const { return connected_; }
  void Send(const json& j) {
    std::string line = j.dump() + "\n";
    ASSERT_EQ(::send(fd_, line.data(), line.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(line.size()));
  }
  void SendRaw(const std::string& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  // The next line as JSON, or null after 5 s.
  json Receive() {
    while (true) {
      size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return json::parse(line);
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return nullptr;
      char buf[1024];
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return nullptr;
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string buffer_;
};

class ControlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("efdl-ctl-test");
    ASSERT_TRUE(dir.ok());
    dir_ = std::move(dir).value();
    auto server = ControlServer::Start({dir_.path() + "/control.sock", "job1", "node-a"});
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    server_->SetRound(3);
  }
  TempDir dir_;
  std::unique_ptr<ControlServer> server_;
};

TEST_F(ControlServerTest, SocketIsPrivateToTheUser) {
  struct stat st {};
  ASSERT_EQ(::stat(server_->path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(ControlServerTest, HelloOfTheCurrentRoundIsWelcomedAndCanBeStopped) {
  RawClient c(server_->path());
  ASSERT_TRUE(c.connected());
  c.Send({{"type", "hello"}, {"version", 1}, {"pid", 42}, {"rank", 5}, {"local_rank", 1},
          {"round", 3}});
  json welcome = c.Receive();
  ASSERT_FALSE(welcome.is_null());
  EXPECT_EQ(welcome["type"], "welcome");
  EXPECT_EQ(welcome["round"], 3);
  EXPECT_EQ(welcome["node_id"], "node-a");
  EXPECT_TRUE(server_->IsConnected(3, 1));
  EXPECT_FALSE(server_->IsConnected(3, 0));
  EXPECT_FALSE(server_->IsConnected(2, 1));

  auto reached = server_->RequestStop(3, true, "scale out");
  ASSERT_EQ(reached, std::vector<int>{1});
  json stop = c.Receive();
  EXPECT_EQ(stop["type"], "stop");
  EXPECT_EQ(stop["graceful"], true);
  EXPECT_EQ(stop["reason"], "scale out");

  c.Send({{"type", "stopping"}, {"round", 3}, {"step", 17}, {"snapshot", true}});
  EXPECT_TRUE(WaitUntil([&] { return server_->StoppingRanks(3) == std::vector<int>{1}; }));
  EXPECT_EQ(server_->newest_step(), std::optional<int64_t>(17));
}

TEST_F(ControlServerTest, HelloFromAnOldRoundIsToldToStop) {
  RawClient c(server_->path());
  c.Send({{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 2}});
  json reply = c.Receive();
  EXPECT_EQ(reply["type"], "stop");
  EXPECT_EQ(reply["round"], 2);
  EXPECT_FALSE(server_->IsConnected(3, 0));
}

TEST_F(ControlServerTest, RestoreQueryAnswersTheNewestReportedStep) {
  RawClient c(server_->path());
  c.Send({{"type", "query"}, {"id", 7}, {"what", "restore"}});
  json reply = c.Receive();
  EXPECT_EQ(reply["id"], 7);
  EXPECT_TRUE(reply["restore_step"].is_null());
  c.Send({{"type", "committed"}, {"step", 40}});
  c.Send({{"type", "committed"}, {"step", 30}});
  c.Send({{"type", "query"}, {"id", 8}, {"what", "restore"}});
  reply = c.Receive();
  EXPECT_EQ(reply["id"], 8);
  EXPECT_EQ(reply["restore_step"], 40);
}

TEST_F(ControlServerTest, GarbageAndUnknownRequestsGetAnErrorAndKeepTheConnection) {
  RawClient c(server_->path());
  c.SendRaw("this is not json\n");
  EXPECT_EQ(c.Receive()["type"], "error");
  c.Send({{"type", "frobnicate"}, {"id", 1}});
  json reply = c.Receive();
  EXPECT_EQ(reply["type"], "error");
  EXPECT_EQ(reply["id"], 1);
  c.Send({{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}});
  EXPECT_EQ(c.Receive()["type"], "welcome");
}

TEST_F(ControlServerTest, DisconnectedWorkerIsForgotten) {
  {
    RawClient c(server_->path());
    c.Send({{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}});
    EXPECT_EQ(c.Receive()["type"], "welcome");
    EXPECT_TRUE(server_->IsConnected(3, 0));
  }
  EXPECT_TRUE(WaitUntil([&] { return !server_->IsConnected(3, 0); }));
}

TEST(ControlServerStartTest, ExistingPathIsRefusedWithAClearMessage) {
  auto dir = TempDir::Create("efdl-ctl-test");
  ASSERT_TRUE(dir.ok());
  std::string path = dir->path() + "/control.sock";
  auto first = ControlServer::Start({path, "j", "n"});
  ASSERT_TRUE(first.ok());
  auto second = ControlServer::Start({path, "j", "n"});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(path), std::string::npos);
}

TEST(ControlServerStartTest, DestructorRemovesTheSocketFile) {
  auto dir = TempDir::Create("efdl-ctl-test");
  ASSERT_TRUE(dir.ok());
  std::string path = dir->path() + "/control.sock";
  { auto s = ControlServer::Start({path, "j", "n"}); ASSERT_TRUE(s.ok()); }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

}  // namespace
}  // namespace efdl::agent
