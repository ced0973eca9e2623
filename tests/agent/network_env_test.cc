// The network side of what workers get: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME /
// HOROVOD_GLOO_IFACE from the advertise address's interface (kept when the user set them), for
// workers and --launcher processes alike; and the worker output lines that say a peer could not
// be reached (ParsePeerConnectError), caught by a real WorkerGroup.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "agent/agent.h"
#include "agent/worker_group.h"
#include "common/net.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

using testing::ExpectVars;
using testing::WaitUntil;

rdzv::Assignment TwoNodes() {
  return testing::MakeAssignment(3, 1, 2, 2, 2, 4, "10.77.0.11", 29400);
}

// Unsets the variables for the test and restores what the environment had.
class NetworkEnvTest : public ::testing::Test {
 protected:
  static constexpr const char* kNames[] = {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                                           "HOROVOD_GLOO_IFACE"};
  void SetUp() override {
    for (const char* n : kNames) {
      if (const char* v = std::getenv(n)) saved_[n] = v;
      ::unsetenv(n);
    }
  }
  void TearDown() override {
    for (const char* n : kNames) {
      if (auto it = saved_.find(n); it != saved_.end()) {
        ::setenv(n, it->second.c_str(), 1);
      } else {
        ::unsetenv(n);
      }
    }
  }
  std::map<std::string, std::string> saved_;
};

TEST_F(NetworkEnvTest, WorkersAndLauncherGetTheInterfaceOfTheAdvertiseAddress) {
  AgentOptions o;
  o.job_id = "j";
  o.node_id = "n";
  o.advertise_addr = "10.77.0.12";
  o.gloo_iface = "eth0";
  for (int lr = 0; lr < 2; ++lr) {
    auto env = WorkerEnvironment(o, TwoNodes(), lr, 0, "/tmp/s");
    ExpectVars(env, {{"GLOO_SOCKET_IFNAME", "eth0"}, {"NCCL_SOCKET_IFNAME", "eth0"},
                     {"HOROVOD_GLOO_IFACE", "eth0"}, {"MASTER_ADDR", "10.77.0.11"}});
  }
  auto launcher = LauncherEnvironment(o, TwoNodes(), 0);
  EXPECT_EQ(launcher["GLOO_SOCKET_IFNAME"], "eth0");
  EXPECT_EQ(launcher["NCCL_SOCKET_IFNAME"], "eth0");
  // No interface known: nothing set, gloo and NCCL choose as they would without EFDL.
  o.gloo_iface.clear();
  auto none = WorkerEnvironment(o, TwoNodes(), 0, 0, "/tmp/s");
  EXPECT_EQ(none.count("GLOO_SOCKET_IFNAME"), 0u);
  EXPECT_EQ(none.count("NCCL_SOCKET_IFNAME"), 0u);
  EXPECT_EQ(none.count("HOROVOD_GLOO_IFACE"), 0u);
}

TEST_F(NetworkEnvTest, ValuesTheUserSetInTheAgentsEnvironmentAreKept) {
  AgentOptions o;
  o.gloo_iface = "eth0";
  ::setenv("GLOO_SOCKET_IFNAME", "ib0", 1);
  ::setenv("HOROVOD_GLOO_IFACE", "ib0", 1);
  auto env = WorkerEnvironment(o, TwoNodes(), 0, 0, "/tmp/s");
  // Not in the added set: the worker inherits the agent's value.
  EXPECT_EQ(env.count("GLOO_SOCKET_IFNAME"), 0u);
  EXPECT_EQ(env.count("HOROVOD_GLOO_IFACE"), 0u);
  EXPECT_EQ(env["NCCL_SOCKET_IFNAME"], "eth0");
  auto launcher = LauncherEnvironment(o, TwoNodes(), 0);
  EXPECT_EQ(launcher.count("GLOO_SOCKET_IFNAME"), 0u);
  EXPECT_EQ(launcher["NCCL_SOCKET_IFNAME"], "eth0");
}

// ParsePeerConnectError finds the peer's `address` in `line`, and its `port` when one is given.
void ExpectPeer(const std::string& line, const std::string& address,
                const std::string& port = "") {
  auto peer = ParsePeerConnectError(line);
  ASSERT_TRUE(peer.has_value()) << line;
  EXPECT_EQ(peer->address, address);
  if (!port.empty()) {
    EXPECT_EQ(peer->port, port);
  }
}

TEST(PeerConnectErrorTest, GlooNcclAndStoreLinesNameTheAddressTried) {
  ASSERT_NO_FATAL_FAILURE(ExpectPeer(
      "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:799] connect "
      "[127.0.1.1]:35161: Connection refused",
      "127.0.1.1", "35161"));
  ASSERT_NO_FATAL_FAILURE(
      ExpectPeer("[pair.cc:799] connect [fd00::10]:4000: No route to host", "fd00::10"));
  ASSERT_NO_FATAL_FAILURE(ExpectPeer(
      "node:123:456 [0] NCCL WARN socketStartConnect: Connect to 10.0.0.2<41235> failed : "
      "Software caused connection abort",
      "10.0.0.2", "41235"));
  ASSERT_NO_FATAL_FAILURE(ExpectPeer(
      "[W socket.cpp:663] [c10d] The client socket has failed to connect to [trainer-1]:29400 "
      "(errno: 111 - Connection refused).",
      "trainer-1", "29400"));
  ASSERT_NO_FATAL_FAILURE(ExpectPeer(
      "torch.distributed.DistStoreError: The client socket has timed out after 60s while "
      "trying to connect to (10.0.0.1, 29500).",
      "10.0.0.1"));
  for (const char* other : {"step 12 loss 0.3", "connected to 10.0.0.1:80", "Connection refused",
                            "reconnecting in 1s", ""}) {
    EXPECT_FALSE(ParsePeerConnectError(other).has_value()) << other;
  }
}

TEST(PeerConnectErrorTest, AWorkerGroupKeepsTheFirstSuchLineWithItsRank) {
  auto dir = TempDir::Create("efdl-net-env-test");
  ASSERT_TRUE(dir.ok());
  int out = ::open((dir->path() + "/out").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  int err = ::open((dir->path() + "/err").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  WorkerGroupOptions o;
  // Rank 5 fails as gloo does; rank 4 prints ordinary output only.
  o.argv = {"sh", "-c",
            "if [ $R = 5 ]; then echo 'RuntimeError: [pair.cc:799] connect [127.0.1.1]:4242: "
            "Connection refused' >&2; exit 1; fi; echo fine; exit 0"};
  o.round = 7;
  o.out_fd = out;
  o.err_fd = err;
  for (int i = 0; i < 2; ++i) {
    WorkerSpec s;
    s.local_rank = i;
    s.rank = 4 + i;
    s.env["R"] = std::to_string(4 + i);
    o.workers.push_back(s);
  }
  auto g = WorkerGroup::Start(std::move(o));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  ASSERT_TRUE(WaitUntil([&] {
    (*g)->Poll();
    return (*g)->running() == 0;
  }));
  (*g)->Close();
  auto e = (*g)->peer_connect_error();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 5);
  EXPECT_EQ(e->address, "127.0.1.1");
  EXPECT_EQ(e->port, "4242");
  ::close(out);
  ::close(err);
}

}  // namespace
}  // namespace efdl::agent
