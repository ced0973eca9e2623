// What the agent gives Horovod: the HOROVOD_* environment of every worker (checked against
// efdl::horovod::AssignSlots, Horovod's own numbering written independently of the agent) and
// the Gloo rendezvous server the rank-0 node runs for exactly as long as its round.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "agent/agent.h"
#include "common/net.h"
#include "horovod/rendezvous_server.h"
#include "horovod/slots.h"
#include "queued_rendezvous.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using rdzv::Assignment;
using rdzv::Event;
using testing::ExpectVars;
using testing::ReadFile;
using testing::WaitUntil;

const std::string kSecret(64, 'c');   // the job's secret (security::NewSecret's form)

// `path` as a client that has round `round`'s token asks for it.
std::string WithToken(int64_t round, const std::string& path) {
  auto token = horovod::RendezvousToken(kSecret, round);
  EXPECT_TRUE(token.ok());
  return "/" + token.value_or("") + path;
}

// node-a runs 1 process, node-b 2: the assignments the coordinator writes for this round
// (rdzv::MemberAssignments; its own tests check that numbering in tests/rendezvous).
Assignment OnePlusTwo(int node_rank, uint16_t horovod_port) {
  Assignment a;
  a.round = 5;
  a.nnodes = 2;
  a.world_size = 3;
  a.master_addr = "127.0.0.1";
  a.master_port = 29555;
  a.horovod_port = horovod_port;
  a.node_rank = node_rank;
  if (node_rank == 0) {
    a.rank_offset = 0;
    a.nproc = 1;
    a.cross_rank = {0};
    a.cross_size = {2};
    a.horovod_hosts = {{"node-a", 1}, {"node-b", 2}};
    a.horovod_clients = {"localhost"};   // resolved by the agent: 127.0.0.1 (and ::1)
  } else {
    a.rank_offset = 1;
    a.nproc = 2;
    a.cross_rank = {1, 0};
    a.cross_size = {2, 1};
  }
  return a;
}

TEST(HorovodEnvironmentTest, OnePlusTwoRoundMatchesHorovodsNumbering) {
  auto expected = horovod::AssignSlots({{"node-a", 1}, {"node-b", 2}});
  ASSERT_TRUE(expected.ok());
  AgentOptions opts;
  opts.job_id = "job-1";
  opts.job_secret = kSecret;
  opts.gloo_iface = "lo";
  size_t checked = 0;
  for (int node_rank = 0; node_rank < 2; ++node_rank) {
    opts.node_id = node_rank == 0 ? "node-a" : "node-b";
    Assignment a = OnePlusTwo(node_rank, 4242);
    for (int lr = 0; lr < a.nproc; ++lr) {
      auto env = WorkerEnvironment(opts, a, lr, 0, "/tmp/sock");
      const horovod::SlotInfo& s = (*expected)[static_cast<size_t>(a.rank_offset + lr)];
      SCOPED_TRACE(fmt::format("{} local rank {}", opts.node_id, lr));
      EXPECT_EQ(env["HOROVOD_HOSTNAME"], s.hostname);
      EXPECT_EQ(env["HOROVOD_RANK"], std::to_string(s.rank));
      EXPECT_EQ(env["HOROVOD_RANK"], env["RANK"]);
      EXPECT_EQ(env["HOROVOD_SIZE"], std::to_string(s.size));
      EXPECT_EQ(env["HOROVOD_LOCAL_RANK"], std::to_string(s.local_rank));
      EXPECT_EQ(env["HOROVOD_LOCAL_SIZE"], std::to_string(s.local_size));
      EXPECT_EQ(env["HOROVOD_CROSS_RANK"], std::to_string(s.cross_rank));
      EXPECT_EQ(env["HOROVOD_CROSS_SIZE"], std::to_string(s.cross_size));
      EXPECT_EQ(env["HOROVOD_CONTROLLER"], "gloo");
      EXPECT_EQ(env["HOROVOD_CPU_OPERATIONS"], "gloo");
      // The round's token rides in the address: Horovod's URLs then start with it.
      EXPECT_EQ(env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                "127.0.0.1:4242" + WithToken(a.round, ""));
      EXPECT_EQ(env["HOROVOD_GLOO_RENDEZVOUS_PORT"], "4242");
      EXPECT_EQ(env["HOROVOD_GLOO_IFACE"], "lo");
      // Workers restart every round: Horovod's own elastic mode stays off.
      EXPECT_EQ(env.count("HOROVOD_ELASTIC"), 0u);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3u);
  // Without the job's secret there is no token: no address either (fail closed).
  opts.job_secret.clear();
  auto env = WorkerEnvironment(opts, OnePlusTwo(1, 4242), 0, 0, "/tmp/sock");
  EXPECT_EQ(env.count("HOROVOD_GLOO_RENDEZVOUS_ADDR"), 0u);
  EXPECT_EQ(env["HOROVOD_RANK"], "1");
}

TEST(HorovodEnvironmentTest, UniformRoundTakesCrossPlaceFromTheNodeRank) {
  AgentOptions opts;
  opts.node_id = "n2";
  Assignment a = testing::MakeAssignment(2, 2, 3, 4, 2, 6, "10.0.0.1", /*master_port=*/0);
  a.horovod_port = 0;   // no server offered: no rendezvous address either
  auto env = WorkerEnvironment(opts, a, 1, 0, "/tmp/sock");
  ExpectVars(env, {{"HOROVOD_RANK", "5"}, {"HOROVOD_LOCAL_SIZE", "2"}, {"HOROVOD_CROSS_RANK", "2"},
                   {"HOROVOD_CROSS_SIZE", "3"}});
  EXPECT_EQ(env.count("HOROVOD_GLOO_RENDEZVOUS_ADDR"), 0u);
  EXPECT_EQ(env.count("HOROVOD_GLOO_RENDEZVOUS_PORT"), 0u);
  EXPECT_EQ(env.count("HOROVOD_GLOO_IFACE"), 0u);
}

TEST(HorovodEnvironmentTest, GlooInterfaceIsTheOneHoldingTheAddress) {
  auto lo = InterfaceOfAddress("127.0.0.1");
  ASSERT_TRUE(lo.ok()) << lo.status().ToString();
  EXPECT_EQ(*lo, "lo");
  auto lo_by_name = InterfaceOfAddress("localhost");
  ASSERT_TRUE(lo_by_name.ok()) << lo_by_name.status().ToString();
  EXPECT_EQ(*lo_by_name, "lo");
  // TEST-NET-3 (RFC 5737): never an address of this machine.
  EXPECT_TRUE(InterfaceOfAddress("203.0.113.7").status().IsNotFound());
  EXPECT_FALSE(InterfaceOfAddress("no-such-host.invalid").ok());
}

// One HTTP/1.0 GET; the body, or "" when nobody answered.
std::string HttpGet(uint16_t port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    std::string req = "GET " + path + " HTTP/1.0\r\n\r\n";
    if (::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof(buf))) > 0) reply.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  size_t body = reply.find("\r\n\r\n");
  return body == std::string::npos ? "" : reply.substr(body + 4);
}

// node-a of job-1, one process, with the job's secret; snapshots below `dir`.
AgentOptions NodeAOptions(const std::string& dir, std::vector<std::string> command) {
  AgentOptions opts;
  opts.job_id = "job-1";
  opts.node_id = "node-a";
  opts.nproc = 1;
  opts.stop_grace = 5s;
  opts.poll_interval = 20ms;
  opts.snapshot_dir = dir + "/snap";
  opts.job_secret = kSecret;
  opts.command = std::move(command);
  return opts;
}

TEST(HorovodRendezvousTest, RankZeroNodeServesItForExactlyItsRound) {
  auto dir = TempDir::Create("efdl-hvd-agent");
  ASSERT_TRUE(dir.ok());
  const std::string d = dir->path();
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  // The worker records its environment and runs until its round is stopped.
  AgentOptions opts =
      NodeAOptions(d, {"sh", "-c", "env > " + d + "/env.$EFDL_ROUND; exec sleep 60"});
  testing::QueuedRendezvous rdzv;  // plays the rest of the job
  Agent agent(opts, rdzv);
  int code = -1;
  std::thread run([&] { code = agent.Run(); });

  rdzv.Push([&] {
    Event e;
    e.type = Event::Type::kRoundStarted;
    e.round = 5;
    e.assignment = OnePlusTwo(0, *port);
    return e;
  }());
  // The round's scopes: node-b's local rank 1 is global rank 2 of 3, cross rank 0 of 1.
  EXPECT_TRUE(WaitUntil([&] {
    return HttpGet(*port, WithToken(5, "/rank_and_size/node-b:1")) == "2,3,1,2,0,1";
  }, 20s));
  EXPECT_EQ(HttpGet(*port, WithToken(5, "/rank_and_size/node-a:0")), "0,3,0,1,0,2");
  // Without the round's token (or with another round's) nothing is served.
  EXPECT_NE(HttpGet(*port, "/rank_and_size/node-a:0").find("token"), std::string::npos);
  EXPECT_NE(HttpGet(*port, WithToken(4, "/rank_and_size/node-a:0")).find("token"),
            std::string::npos);
  EXPECT_TRUE(WaitUntil([&] { return ReadFile(d + "/env.5").find("HOROVOD_GLOO_RENDEZVOUS_PORT=" +
                                                                  std::to_string(*port) + "\n") !=
                                     std::string::npos; },
                        20s));

  // Round 6 places this node second: it must stop serving when round 5 closes, and not serve.
  Event closing;
  closing.type = Event::Type::kRoundClosing;
  closing.round = 5;
  rdzv.Push(closing);
  EXPECT_TRUE(WaitUntil([&] { return !TcpConnectable("127.0.0.1", *port, 100); }, 20s));
  Event next;
  next.type = Event::Type::kRoundStarted;
  next.round = 6;
  next.assignment = OnePlusTwo(1, *port);
  next.assignment.round = 6;
  rdzv.Push(next);
  EXPECT_TRUE(WaitUntil([&] { return ReadFile(d + "/env.6").find("HOROVOD_RANK=") !=
                                     std::string::npos; },
                        20s));
  EXPECT_FALSE(TcpConnectable("127.0.0.1", *port, 100));

  Event done;
  done.type = Event::Type::kJobComplete;
  done.round = 6;
  rdzv.Push(done);
  run.join();
  EXPECT_EQ(code, 0);
}

// An agent of node-a, rank 0 of round 5 (OnePlusTwo) whose members' addresses are `clients`,
// serving the round's Gloo rendezvous until Finish().
class RankZeroAgentOfRoundFive {
 public:
  explicit RankZeroAgentOfRoundFive(std::vector<std::string> clients) {
    auto dir = TempDir::Create("efdl-hvd-agent");
    auto port = PickFreePort("127.0.0.1");
    if (!dir.ok() || !port.ok()) return;
    dir_ = std::move(dir).value();
    port_ = *port;
    agent_ = std::make_unique<Agent>(NodeAOptions(dir_.path(), {"sleep", "60"}), rdzv_);
    run_ = std::thread([this] { code_ = agent_->Run(); });
    Event e;
    e.type = Event::Type::kRoundStarted;
    e.round = 5;
    e.assignment = OnePlusTwo(0, port_);
    e.assignment.horovod_clients = std::move(clients);
    rdzv_.Push(e);
  }
  uint16_t port() const { return port_; }
  bool Serving() const {
    return port_ != 0 && WaitUntil([&] { return TcpConnectable("127.0.0.1", port_, 100); }, 20s);
  }
  // Ends the job; the agent's exit code.
  int Finish() {
    if (!run_.joinable()) return -1;
    Event done;
    done.type = Event::Type::kJobComplete;
    done.round = 5;
    rdzv_.Push(done);
    run_.join();
    return code_;
  }
  ~RankZeroAgentOfRoundFive() { Finish(); }

 private:
  TempDir dir_;
  uint16_t port_ = 0;
  testing::QueuedRendezvous rdzv_;  // plays the rest of the job
  std::unique_ptr<Agent> agent_;
  int code_ = -1;
  std::thread run_;
};

TEST(HorovodRendezvousTest, ClientsOutsideTheRoundAreRefused) {
  RankZeroAgentOfRoundFive node({"127.0.0.2"});   // the members: we (127.0.0.1) are not one
  ASSERT_TRUE(node.Serving());
  // Refused even with the token.
  const std::string reply = HttpGet(node.port(), WithToken(5, "/rank_and_size/node-a:0"));
  EXPECT_EQ(reply.find("0,3,0,1,0,2"), std::string::npos) << reply;
  EXPECT_NE(reply.find("not a member"), std::string::npos) << reply;
  EXPECT_EQ(node.Finish(), 0);
}

// A member's name that does not resolve on the rank-0 node turns the address filter off for
// the round; the token still guards the server: it fails closed, never open.
TEST(HorovodRendezvousTest, AnUnresolvableMemberLeavesTheTokenGuardingTheServer) {
  RankZeroAgentOfRoundFive node({"no-such-member.invalid"});
  ASSERT_TRUE(node.Serving());
  const std::string stranger = HttpGet(node.port(), "/rank_and_size/node-a:0");
  EXPECT_EQ(stranger.find("0,3,0,1,0,2"), std::string::npos) << stranger;
  EXPECT_NE(stranger.find("token"), std::string::npos) << stranger;
  EXPECT_EQ(HttpGet(node.port(), WithToken(5, "/rank_and_size/node-a:0")), "0,3,0,1,0,2");
  EXPECT_EQ(node.Finish(), 0);
}

}  // namespace
}  // namespace efdl::agent
