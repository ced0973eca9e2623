// Drives the rendezvous server over real loopback sockets with a client written here (raw
// sockets, no code shared with the server), plus Python's urllib as an independent standard
// client.
#include "horovod/rendezvous_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/subprocess.h"

namespace efdl::horovod {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A blocking TCP connection to 127.0.0.1:port, closed on destruction.
class TestConn {
 public:
  explicit TestConn(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~TestConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool SendAll(std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // Everything until the server closes, or nullopt if it did not close within `timeout`.
  std::optional<std::string> ReadToEof(std::chrono::milliseconds timeout = 10s) {
    std::string out;
    auto deadline = Clock::now() + timeout;
    while (true) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return std::nullopt;
      char buf[65536];
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n < 0) return errno == ECONNRESET ? std::optional<std::string>(out) : std::nullopt;
      if (n == 0) return out;
      out.append(buf, static_cast<size_t>(n));
    }
  }
  // Reads exactly n bytes (or fewer if the server closes / time runs out).
  std::string ReadSome(size_t n, std::chrono::milliseconds timeout = 10s) {
    std::string out;
    auto deadline = Clock::now() + timeout;
    while (out.size() < n && Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char buf[256];
      ssize_t got = ::recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }

 private:
  int fd_ = -1;
};

struct Reply {
  int status = 0;  // 0: no parsable answer
  std::string body;
};

Reply ParseReply(const std::string& raw) {
  Reply r;
  size_t head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos) return r;
  r.status = std::atoi(raw.c_str() + 9);
  r.body = raw.substr(head_end + 4);
  // The declared length must match what came.
  auto cl = raw.find("Content-Length: ");
  if (cl == std::string::npos || cl > head_end ||
      std::stoul(raw.substr(cl + 16)) != r.body.size()) {
    r.status = -1;
  }
  return r;
}

Reply Raw(uint16_t port, std::string_view request) {
  TestConn c(port);
  if (!c.ok() || !c.SendAll(request)) return {};
  auto raw = c.ReadToEof();
  return raw ? ParseReply(*raw) : Reply{};
}

// Every server of these tests has this token unless the test gives another.
constexpr std::string_view kToken = "00112233445566778899aabbccddeeff";

// `path` ("/<scope>/<key>") as a client that has the token asks for it.
std::string P(std::string_view path) { return fmt::format("/{}{}", kToken, path); }

// A request line whose target is used as it is (no token added).
Reply HttpTarget(uint16_t port, std::string_view method, std::string_view target,
                 std::optional<std::string_view> body = std::nullopt, std::string extra = "") {
  std::string req = fmt::format("{} {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n{}", method, target,
                                port, extra);
  if (body) req += fmt::format("Content-Length: {}\r\n", body->size());
  req += "\r\n";
  if (body) req += *body;
  return Raw(port, req);
}

// A request of a client that has the token, for "/<scope>/<key>".
Reply Http(uint16_t port, std::string_view method, std::string_view path,
           std::optional<std::string_view> body = std::nullopt, std::string extra = "") {
  return HttpTarget(port, method, P(path), body, std::move(extra));
}

std::vector<SlotInfo> Round(const std::vector<HostSlots>& hosts) {
  auto r = AssignSlots(hosts);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

std::unique_ptr<RendezvousServer> StartServer(const std::vector<HostSlots>& hosts,
                                              RendezvousServerOptions o = {}) {
  if (o.token.empty()) o.token = std::string(kToken);
  auto s = RendezvousServer::Start(std::move(o), Round(hosts));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  EXPECT_NE((*s)->port(), 0);
  return std::move(*s);
}

TEST(HorovodRendezvousServerTest, GetIs404UntilPutThenReturnsTheBody) {
  auto server = StartServer({{"a", 2}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  EXPECT_EQ(Http(port, "GET", "/global/rank_0").status, 404);
  EXPECT_EQ(Http(port, "PUT", "/global/rank_0", "hello").status, 200);
  Reply r = Http(port, "GET", "/global/rank_0");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "hello");
  EXPECT_EQ(Http(port, "GET", "/local_a/rank_0").status, 404);  // scopes are separate
  EXPECT_EQ(Http(port, "PUT", "/global/rank_0", "").status, 200);  // overwrite, empty value
  r = Http(port, "GET", "/global/rank_0");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "");
}

TEST(HorovodRendezvousServerTest, BinaryValuesRoundTrip) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  all += "\r\n\r\nHTTP/1.1 200 OK\r\n";
  std::string big(3 * 1024 * 1024 + 7, '\0');
  std::mt19937 rng(7);
  for (auto& ch : big) ch = static_cast<char>(rng());
  for (const std::string& v : {all, big}) {
    ASSERT_EQ(Http(server->port(), "PUT", "/global/blob", v).status, 200);
    Reply r = Http(server->port(), "GET", "/global/blob");
    ASSERT_EQ(r.status, 200);
    EXPECT_TRUE(r.body == v) << "value of " << v.size() << " bytes came back as "
                             << r.body.size() << " different bytes";
  }
}

TEST(HorovodRendezvousServerTest, KnownScopeIsClearedOnlyWhenEveryRankDeleted) {
  auto server = StartServer({{"a", 2}, {"b", 1}});  // global 3, local_a 2, local_b 1
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(Http(port, "PUT", fmt::format("/global/rank_{}", r), "v").status, 200);
  }
  EXPECT_EQ(Http(port, "DELETE", "/global/0").status, 200);
  EXPECT_EQ(Http(port, "DELETE", "/global/1").status, 200);
  EXPECT_EQ(Http(port, "DELETE", "/global/1").status, 200);  // a retried DELETE counts once
  EXPECT_EQ(Http(port, "GET", "/global/rank_2").status, 200);
  EXPECT_EQ(server->store().KeyCount("global"), 3u);
  EXPECT_EQ(Http(port, "DELETE", "/global/2").status, 200);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(Http(port, "GET", fmt::format("/global/rank_{}", r)).status, 404);
  }
  // The local scope of a has its own size (2) and is untouched by the global clearing.
  ASSERT_EQ(Http(port, "PUT", "/local_a/k", "x").status, 200);
  EXPECT_EQ(Http(port, "DELETE", "/local_a/0").status, 200);
  EXPECT_EQ(Http(port, "GET", "/local_a/k").status, 200);
  EXPECT_EQ(Http(port, "DELETE", "/local_a/1").status, 200);
  EXPECT_EQ(Http(port, "GET", "/local_a/k").status, 404);
  // A scope can be used again after clearing (the next context of the same name).
  ASSERT_EQ(Http(port, "PUT", "/global/rank_0", "again").status, 200);
  EXPECT_EQ(Http(port, "GET", "/global/rank_0").body, "again");
  EXPECT_EQ(server->store().ScopeSize("cross_0"), 2);
  EXPECT_EQ(server->store().ScopeSize("cross_1"), 1);
}

TEST(HorovodRendezvousServerTest, AdHocScopeDeleteRemovesThatKey) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  ASSERT_EQ(Http(port, "PUT", "/global_process_set_hash_1f/0", "x").status, 200);
  ASSERT_EQ(Http(port, "PUT", "/global_process_set_hash_1f/1", "y").status, 200);
  EXPECT_EQ(Http(port, "DELETE", "/global_process_set_hash_1f/0").status, 200);
  EXPECT_EQ(Http(port, "GET", "/global_process_set_hash_1f/0").status, 404);
  EXPECT_EQ(Http(port, "GET", "/global_process_set_hash_1f/1").body, "y");
  EXPECT_EQ(Http(port, "DELETE", "/no_such_scope/0").status, 200);
}

TEST(HorovodRendezvousServerTest, RankAndSizeAnswersTheRoundAndMinusOnesForStrangers) {
  auto server = StartServer({{"a", 2}, {"b", 1}, {"c", 3}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  EXPECT_EQ(Http(port, "GET", "/rank_and_size/c:1").body, "4,6,1,3,1,2");
  EXPECT_EQ(Http(port, "GET", "/rank_and_size/a:0").body, "0,6,0,2,0,3");
  Reply gone = Http(port, "GET", "/rank_and_size/d:0");
  EXPECT_EQ(gone.status, 200);
  EXPECT_EQ(gone.body, "-1,-1,-1,-1,-1,-1");
  EXPECT_EQ(Http(port, "GET", "/rank_and_size/b:1").body, "-1,-1,-1,-1,-1,-1");
  // The next round (same server): b is gone, a has 1 process.
  server->SetRound(Round({{"a", 1}, {"c", 3}}));
  EXPECT_EQ(Http(port, "GET", "/rank_and_size/b:0").body, "-1,-1,-1,-1,-1,-1");
  EXPECT_EQ(Http(port, "GET", "/rank_and_size/c:2").body, "3,4,2,3,0,1");
}

TEST(HorovodRendezvousServerTest, SetRoundForgetsValuesAndDeletes) {
  auto server = StartServer({{"a", 2}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  ASSERT_EQ(Http(port, "PUT", "/global/k", "v").status, 200);
  ASSERT_EQ(Http(port, "DELETE", "/global/0").status, 200);
  server->SetRound(Round({{"a", 2}}));
  EXPECT_EQ(Http(port, "GET", "/global/k").status, 404);
  ASSERT_EQ(Http(port, "PUT", "/global/k", "v").status, 200);
  ASSERT_EQ(Http(port, "DELETE", "/global/1").status, 200);  // the old DELETE of 0 is forgotten
  EXPECT_EQ(Http(port, "GET", "/global/k").status, 200);
}

// Each thread plays one Horovod worker through hvd.init()'s three Gloo contexts: PUT its
// address, poll GET for every peer's (404 until there), then DELETE its rank in the scope.
TEST(HorovodRendezvousServerTest, SimulatedWorkersRendezvousInAllScopesAndLeaveThemEmpty) {
  std::vector<HostSlots> hosts = {{"a", 2}, {"b", 1}, {"c", 3}};
  auto server = StartServer(hosts);
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  auto slots = Round(hosts);
  std::atomic<int> failures{0};
  std::vector<std::thread> workers;
  for (const auto& s : slots) {
    workers.emplace_back([&, s] {
      auto fail = [&](const std::string& why) {
        ++failures;
        ADD_FAILURE() << "rank " << s.rank << ": " << why;
      };
      struct Ctx {
        std::string scope;
        int rank, size;
      };
      for (const Ctx& ctx : {Ctx{"global", s.rank, s.size},
                             Ctx{"local_" + s.hostname, s.local_rank, s.local_size},
                             Ctx{"cross_" + std::to_string(s.local_rank), s.cross_rank,
                                 s.cross_size}}) {
        std::string mine = fmt::format("addr-of-global-rank-{}", s.rank);
        if (Http(port, "PUT", fmt::format("/{}/rank_{}", ctx.scope, ctx.rank), mine).status !=
            200) {
          return fail("PUT failed in " + ctx.scope);
        }
        for (int peer = 0; peer < ctx.size; ++peer) {
          auto deadline = Clock::now() + 20s;
          Reply r;
          while ((r = Http(port, "GET", fmt::format("/{}/rank_{}", ctx.scope, peer))).status ==
                     404 &&
                 Clock::now() < deadline) {
            std::this_thread::sleep_for(10ms);  // Horovod's client polls every 10 ms too
          }
          if (r.status != 200 || r.body.rfind("addr-of-global-rank-", 0) != 0) {
            return fail(fmt::format("peer {} in {} answered {}", peer, ctx.scope, r.status));
          }
        }
        // Gloo's barrier: nobody deletes before everyone has read everything.
        std::string barrier_key = fmt::format("/barrier_{}/{}", ctx.scope, ctx.rank);
        Http(port, "PUT", barrier_key, "1");
        for (int peer = 0; peer < ctx.size; ++peer) {
          auto deadline = Clock::now() + 20s;
          while (Http(port, "GET", fmt::format("/barrier_{}/{}", ctx.scope, peer)).status != 200 &&
                 Clock::now() < deadline) {
            std::this_thread::sleep_for(10ms);
          }
        }
        if (Http(port, "DELETE", fmt::format("/{}/{}", ctx.scope, ctx.rank)).status != 200) {
          return fail("DELETE failed in " + ctx.scope);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (std::string scope : {"global", "local_a", "local_b", "local_c", "cross_0", "cross_1",
                            "cross_2"}) {
    EXPECT_EQ(server->store().KeyCount(scope), 0u) << scope << " was not cleared";
  }
}

TEST(HorovodRendezvousServerTest, ManyConcurrentClientsKeepTheirValues) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  constexpr int kThreads = 16, kKeys = 40;
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int k = 0; k < kKeys; ++k) {
        std::string key = fmt::format("/s{}/k{}", t % 3, t * 1000 + k);
        std::string value(static_cast<size_t>(1 + (t * 131 + k * 17) % 5000), static_cast<char>('a' + t));
        if (Http(port, "PUT", key, value).status != 200) ++bad;
        Reply r = Http(port, "GET", key);
        if (r.status != 200 || r.body != value) ++bad;
      }
    });
  }
  // Meanwhile, clients that connect and stall must not hold anyone up.
  std::vector<std::unique_ptr<TestConn>> stalled;
  for (int i = 0; i < 20; ++i) {
    stalled.push_back(std::make_unique<TestConn>(port));
    stalled.back()->SendAll("GET /s0/");
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(server->store().KeyCount("s0") + server->store().KeyCount("s1") +
                server->store().KeyCount("s2"),
            static_cast<size_t>(kThreads * kKeys));
}

TEST(HorovodRendezvousServerTest, MalformedRequestsGetAnErrorAndTheServerKeepsServing) {
  RendezvousServerOptions o;
  o.max_body_bytes = 1024;
  o.max_header_bytes = 2048;
  auto server = StartServer({{"a", 1}}, o);
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  ASSERT_EQ(Http(port, "PUT", "/global/k", "v").status, 200);
  struct Case {
    std::string raw;
    int status;
  };
  std::vector<Case> cases = {
      {"hello there\r\n\r\n", 400},
      {"GET /onlyscope HTTP/1.1\r\n\r\n", 400},
      {"GET /a/b/c HTTP/1.1\r\n\r\n", 400},
      {"GET //b HTTP/1.1\r\n\r\n", 400},
      {"GET /a/ HTTP/1.1\r\n\r\n", 400},
      {"GET http://x/a/b HTTP/1.1\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: zz\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\n\r\n", 411},
      {"POST /a/b HTTP/1.1\r\nContent-Length: 1\r\n\r\nx", 405},
      {"GET /a/b HTTP/3.0\r\n\r\n", 505},
      {"PUT /a/b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n", 501},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'x'), 413},
      {"GET /a/b HTTP/1.1\r\nX: " + std::string(4000, 'h') + "\r\n\r\n", 431},
      {std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 15), 400},
  };
  for (auto& c : cases) {
    // Past the token check, so that the path itself is judged (a parse error comes first).
    if (size_t sp = c.raw.find(" /"); sp != std::string::npos && sp < 8) {
      c.raw.insert(sp + 1, P(""));
    }
    Reply r = Raw(port, c.raw);
    EXPECT_EQ(r.status, c.status) << c.raw.substr(0, 50);
    EXPECT_FALSE(r.body.empty()) << "an error answer says what is wrong";
    EXPECT_EQ(Http(port, "GET", "/global/k").body, "v") << "after " << c.raw.substr(0, 50);
  }
  // Clients that vanish half-way are dropped without an answer and without harm.
  {
    TestConn c(port);
    c.SendAll("PUT /global/k HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc");
  }
  { TestConn c(port); }
  EXPECT_EQ(Http(port, "GET", "/global/k").body, "v");  // the half PUT changed nothing
  EXPECT_EQ(server->stats().rejected, cases.size());
}

TEST(HorovodRendezvousServerTest, SlowRequestTimesOutWith408) {
  RendezvousServerOptions o;
  o.request_timeout = 300ms;
  auto server = StartServer({{"a", 1}}, o);
  ASSERT_TRUE(server);
  TestConn slow(server->port());
  ASSERT_TRUE(slow.SendAll("PUT /global/k HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"));
  auto start = Clock::now();
  auto raw = slow.ReadToEof(10s);
  ASSERT_TRUE(raw.has_value());
  EXPECT_EQ(ParseReply(*raw).status, 408);
  EXPECT_GE(Clock::now() - start, 200ms);
  TestConn silent(server->port());
  auto nothing = silent.ReadToEof(10s);  // connected but never sent a byte: closed quietly
  ASSERT_TRUE(nothing.has_value());
  EXPECT_EQ(*nothing, "");
  EXPECT_EQ(server->stats().timed_out, 2u);
  EXPECT_EQ(Http(server->port(), "GET", "/global/k").status, 404);
}

TEST(HorovodRendezvousServerTest, ExpectContinueGetsAnInterimAnswer) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  TestConn c(server->port());
  ASSERT_TRUE(c.SendAll("PUT " + P("/global/k") +
                        " HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"));
  std::string interim = "HTTP/1.1 100 Continue\r\n\r\n";
  EXPECT_EQ(c.ReadSome(interim.size()), interim);
  ASSERT_TRUE(c.SendAll("data"));
  auto raw = c.ReadToEof();
  ASSERT_TRUE(raw.has_value());
  EXPECT_EQ(ParseReply(*raw).status, 200);
  EXPECT_EQ(Http(server->port(), "GET", "/global/k").body, "data");
}

TEST(HorovodRendezvousServerTest, OnlyRequestsThatCarryTheRoundsTokenAreServed) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  const std::string token(kToken);
  struct Case {
    std::string target;
    int status;
  };
  std::vector<Case> cases = {
      {"/global/k", 403},                                        // no token
      {"/ffffffffffffffffffffffffffffffff/global/k", 403},       // another token
      {"/" + token.substr(0, 31) + "/global/k", 403},            // a prefix of it
      {"/" + token + "0/global/k", 403},                         // longer
      {"/" + token + ":x1/global/k", 403},                       // not a port after ':'
      {"/" + token + ":/global/k", 403},
      {"/" + token, 403},                                        // nothing after it
      {"/" + token + "/global/k", 200},
      {"/" + token + ":" + std::to_string(port) + "/global/k", 200},  // as Horovod builds it
  };
  for (const auto& c : cases) {
    Reply r = HttpTarget(port, "PUT", c.target, "v");
    EXPECT_EQ(r.status, c.status) << c.target;
    if (c.status == 403) {
      EXPECT_NE(r.body.find("token"), std::string::npos) << r.body;
      EXPECT_EQ(r.body.find(token), std::string::npos) << "an answer never shows the token";
    }
  }
  EXPECT_EQ(server->store().KeyCount("global"), 1u);

  // No token, no server: it never serves without one.
  for (std::string bad : {std::string(), std::string("short"), std::string(32, 'G')}) {
    RendezvousServerOptions o;
    o.token = bad;
    auto refused = RendezvousServer::Start(o, Round({{"a", 1}}));
    ASSERT_FALSE(refused.ok()) << "token '" << bad << "'";
    EXPECT_NE(refused.status().message().find("token"), std::string::npos);
  }
}

TEST(HorovodRendezvousServerTest, TheTokenIsTheJobsAndTheRoundsOwn) {
  const std::string secret(64, 'a');
  auto t1 = RendezvousToken(secret, 1);
  ASSERT_TRUE(t1.ok()) << t1.status().ToString();
  EXPECT_EQ(t1->size(), 32u);
  EXPECT_EQ(*t1, *RendezvousToken(secret, 1)) << "every agent of the job computes the same one";
  EXPECT_NE(*t1, *RendezvousToken(secret, 2));
  EXPECT_NE(*t1, *RendezvousToken(std::string(64, 'b'), 1));
  EXPECT_EQ(t1->find(secret.substr(0, 8)), std::string::npos);
  EXPECT_FALSE(RendezvousToken("", 1).ok()) << "fail closed without the job's secret";
  RendezvousServerOptions o;
  o.token = *t1;
  EXPECT_TRUE(RendezvousServer::Start(o, Round({{"a", 1}})).ok());
}

TEST(HorovodRendezvousServerTest, AllowedClientsAreEnforcedBesidesTheToken) {
  RendezvousServerOptions only_others;
  only_others.allowed_clients = {"10.9.9.9"};
  auto closed = StartServer({{"a", 1}}, only_others);
  ASSERT_TRUE(closed);
  Reply r = Http(closed->port(), "GET", "/global/k");
  EXPECT_EQ(r.status, 403);
  EXPECT_NE(r.body.find("127.0.0.1"), std::string::npos) << r.body;
  RendezvousServerOptions loopback;
  loopback.allowed_clients = {"10.9.9.9", "127.0.0.1"};
  auto open = StartServer({{"a", 1}}, loopback);
  ASSERT_TRUE(open);
  EXPECT_EQ(Http(open->port(), "GET", "/global/k").status, 404);
}

TEST(HorovodRendezvousServerTest, StopClosesConnectedClientsAndThePort) {
  auto server = StartServer({{"a", 1}});
  ASSERT_TRUE(server);
  uint16_t port = server->port();
  std::vector<std::unique_ptr<TestConn>> clients;
  for (int i = 0; i < 8; ++i) {
    clients.push_back(std::make_unique<TestConn>(port));
    ASSERT_TRUE(clients.back()->ok());
    if (i % 2) clients.back()->SendAll("PUT /global/k HTTP/1.1\r\nContent-Length: 100\r\n\r\nab");
  }
  // Make sure the server has accepted them all before stopping.
  ASSERT_EQ(Http(port, "GET", "/global/none").status, 404);
  auto start = Clock::now();
  server->Stop();
  EXPECT_LT(Clock::now() - start, 2s);
  for (auto& c : clients) {
    auto rest = c->ReadToEof(5s);
    EXPECT_TRUE(rest.has_value()) << "a client was left hanging after Stop()";
  }
  TestConn late(port);
  EXPECT_FALSE(late.ok()) << "the port still accepts connections after Stop()";
  server->Stop();  // idempotent
  server.reset();
}

TEST(HorovodRendezvousServerTest, BindErrorsAreOneClearLine) {
  RendezvousServerOptions bad;
  bad.token = std::string(kToken);
  bad.bind_addr = "no-such-host.invalid";
  auto r = RendezvousServer::Start(bad, Round({{"a", 1}}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no-such-host.invalid"), std::string::npos);

  auto first = StartServer({{"a", 1}});
  ASSERT_TRUE(first);
  RendezvousServerOptions same;
  same.token = std::string(kToken);
  same.port = first->port();
  auto clash = RendezvousServer::Start(same, Round({{"a", 1}}));
  ASSERT_FALSE(clash.ok());
  EXPECT_NE(clash.status().message().find(std::to_string(first->port())), std::string::npos)
      << clash.status().message();
}

TEST(HorovodRendezvousServerTest, PythonUrllibClientSpeaksToIt) {
  auto server = StartServer({{"a", 2}});
  ASSERT_TRUE(server);
  std::string script = R"PY(
import sys, urllib.request, urllib.error
# As Horovod builds its URLs: "http://" + HOROVOD_GLOO_RENDEZVOUS_ADDR + ":" + PORT + path.
base = "http://%s:%s" % (sys.argv[2], sys.argv[1])
def req(method, path, data=None):
    r = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(r, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
assert req("GET", "/global/rank_0")[0] == 404
blob = bytes(range(256)) * 3
assert req("PUT", "/global/rank_0", blob) == (200, b"")
assert req("GET", "/global/rank_0") == (200, blob)
assert req("GET", "/rank_and_size/a:1") == (200, b"1,2,1,2,0,1")
assert req("DELETE", "/global/0")[0] == 200
assert req("GET", "/global/rank_0") == (200, blob)
assert req("DELETE", "/global/1")[0] == 200
assert req("GET", "/global/rank_0")[0] == 404
code, body = req("POST", "/global/x", b"1")
assert code == 405 and body, (code, body)
print("ok")
)PY";
  SpawnOptions so;
  so.argv = {"/usr/bin/python3", "-c", script, std::to_string(server->port()),
             HorovodAddrWithToken("127.0.0.1", server->port(), std::string(kToken))};
  so.stdout_mode = SpawnOptions::Stdio::kPipe;
  so.stderr_to_stdout = true;
  auto p = Subprocess::Spawn(so);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p->stdout_fd(), buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  auto st = p->WaitFor(30s);
  if (!st) p->Stop(100ms);
  ASSERT_TRUE(st.has_value()) << "python client did not finish";
  EXPECT_TRUE(WaitStatusSuccess(*st)) << DescribeWaitStatus(*st) << "\n" << out;
  EXPECT_EQ(out, "ok\n");
}

}  // namespace
}  // namespace efdl::horovod
