#include "agent/control_server.h"
#include "agent/round_reports.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/net.h"
#include "control_conn.h"
#include "test_util.h"

namespace efdl::agent {
namespace {

using nlohmann::json;
using testing::ControlConn;
using testing::WaitUntil;

class ControlServerTest : public testing::ControlServerFixture {};

// Says hello for (rank, local_rank) of `round` on `c` and returns the answer's type.
std::string Hello(ControlConn& c, int pid, int rank, int local_rank, int64_t round) {
  if (!c.SendJson({{"type", "hello"}, {"pid", pid}, {"rank", rank}, {"local_rank", local_rank},
                   {"round", round}})) {
    return "(not sent)";
  }
  json reply = c.ReadJson();
  return reply.is_object() ? reply.value("type", "") : "(no answer)";
}

TEST_F(ControlServerTest, SocketIsPrivateToTheUser) {
  struct stat st {};
  ASSERT_EQ(::stat(server_->path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(ControlServerTest, HelloOfTheCurrentRoundIsWelcomedAndCanBeStopped) {
  ControlChannel channel(*server_);   // the agent's books of the reports
  ControlConn c(server_->path());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.SendJson({{"type", "hello"}, {"version", 1}, {"pid", 42}, {"rank", 5},
                          {"local_rank", 1}, {"round", 3}}));
  json welcome = c.ReadJson();
  ASSERT_FALSE(welcome.is_null());
  EXPECT_EQ(welcome["type"], "welcome");
  EXPECT_EQ(welcome["round"], 3);
  EXPECT_EQ(welcome["node_id"], "node-a");
  EXPECT_TRUE(server_->IsConnected(3, 1));
  EXPECT_FALSE(server_->IsConnected(3, 0));
  EXPECT_FALSE(server_->IsConnected(2, 1));

  auto reached = server_->RequestStop(3, true, "scale out");
  ASSERT_EQ(reached, std::vector<int>{1});
  json stop = c.ReadJson();
  EXPECT_EQ(stop["type"], "stop");
  EXPECT_EQ(stop["graceful"], true);
  EXPECT_EQ(stop["reason"], "scale out");

  ASSERT_TRUE(c.SendJson({{"type", "stopping"}, {"round", 3}, {"step", 17}, {"snapshot", true}}));
  EXPECT_TRUE(WaitUntil([&] { return channel.StoppingRanks(3) == std::vector<int>{1}; }));
  EXPECT_EQ(server_->newest_step(), std::optional<int64_t>(17));
}

TEST_F(ControlServerTest, InProcessWorkersArePausedReportAndAreMovedToTheNextRound) {
  ControlChannel channel(*server_);   // the agent's books of the reports
  ControlConn c(server_->path());
  ControlConn plain(server_->path());
  ASSERT_EQ(Hello(c, 7, 5, 1, 3), "welcome");
  ASSERT_EQ(Hello(plain, 8, 4, 0, 3), "welcome");
  ASSERT_TRUE(c.SendJson({{"type", "in_process"}, {"round", 3}}));
  json accepted = c.ReadJson();
  EXPECT_EQ(accepted["type"], "in_process");
  EXPECT_EQ(accepted["accepted"], true);
  EXPECT_EQ(server_->InProcessRanks(3), std::vector<int>{1}) << "counted before the answer";

  EXPECT_EQ(server_->RequestPause(3, true, "node c joined"), std::vector<int>{1})
      << "a worker that did not say in_process is never paused";
  json pause = c.ReadJson();
  EXPECT_EQ(pause["type"], "pause");
  EXPECT_EQ(pause["graceful"], true);
  EXPECT_EQ(plain.ReadJson(std::chrono::milliseconds(200)), nullptr);

  // Reports count for the worker's own round, whatever round they name.
  ASSERT_TRUE(c.SendJson({{"type", "failed"}, {"round", 99}, {"message", "Connection reset"}}));
  ASSERT_TRUE(c.SendJson({{"type", "paused"}, {"round", 99}, {"step", 18}, {"snapshot", false}}));
  ASSERT_TRUE(WaitUntil([&] { return channel.PausedRanks(3) == std::vector<int>{1}; }));
  EXPECT_TRUE(channel.PausedRanks(99).empty());
  auto failures = channel.TakeInProcessFailures();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].round, 3);
  EXPECT_EQ(failures[0].rank, 5);
  EXPECT_EQ(failures[0].message, "Connection reset");
  EXPECT_TRUE(channel.TakeInProcessFailures().empty()) << "taken once";
  // A rank whose program returned says so, for its own round too.
  EXPECT_TRUE(channel.ReturnedRanks(3).empty());
  ASSERT_TRUE(c.SendJson({{"type", "returned"}, {"round", 99}}));
  ASSERT_TRUE(WaitUntil([&] { return channel.ReturnedRanks(3) == std::vector<int>{1}; }));
  EXPECT_TRUE(channel.ReturnedRanks(99).empty());
  EXPECT_EQ(server_->newest_step(), std::optional<int64_t>(18));

  EXPECT_TRUE(server_->AssignRound(3, 1, 4, 9, {{"RANK", "9"}, {"WORLD_SIZE", "10"}}));
  json next = c.ReadJson();
  EXPECT_EQ(next["type"], "round");
  EXPECT_EQ(next["round"], 4);
  EXPECT_EQ(next["rank"], 9);
  EXPECT_EQ(next["local_rank"], 1);
  EXPECT_EQ(next["env"]["RANK"], "9");
  EXPECT_EQ(server_->InProcessRanks(4), std::vector<int>{1});
  EXPECT_FALSE(server_->AssignRound(3, 1, 5, 9, {})) << "it belongs to round 4 now";
  EXPECT_FALSE(server_->AssignRound(3, 0, 4, 8, {})) << "the plain worker is never assigned";
  EXPECT_EQ(server_->RequestStop(4, true, "standby"), std::vector<int>{1});
  EXPECT_EQ(c.ReadJson()["type"], "stop");
}

TEST_F(ControlServerTest, ARaisedProgramIsItsOwnFailureAndAReturnCountsOnceUnlessAskedToStop) {
  ControlChannel channel(*server_);   // the agent's books of the reports
  ControlConn a(server_->path());
  ControlConn b(server_->path());
  ASSERT_EQ(Hello(a, 7, 5, 1, 3), "welcome");
  ASSERT_EQ(Hello(b, 8, 4, 0, 3), "welcome");
  // The program's own exception, and a collective that lost a peer: only the first is its own.
  ASSERT_TRUE(a.SendJson({{"type", "raised"}, {"round", 3}, {"message", "ValueError: bug"}}));
  ASSERT_TRUE(b.SendJson({{"type", "failed"}, {"round", 3}, {"message", "Connection reset"}}));
  std::vector<InProcessFailure> failures;
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& f : channel.TakeInProcessFailures()) failures.push_back(f);
    return failures.size() == 2;
  }));
  std::ranges::sort(failures, {}, &InProcessFailure::rank);
  EXPECT_EQ(failures[0].rank, 4);
  EXPECT_FALSE(failures[0].own);
  EXPECT_EQ(failures[1].rank, 5);
  EXPECT_TRUE(failures[1].own);
  EXPECT_EQ(failures[1].message, "ValueError: bug");
  // Said twice, counted once: a node of two ranks where one returned is not "all returned".
  ASSERT_TRUE(a.SendJson({{"type", "returned"}, {"round", 3}}));
  ASSERT_TRUE(a.SendJson({{"type", "returned"}, {"round", 3}}));
  // A rank that said `stopping` exits 0 because it was asked to: not an early return.
  ASSERT_TRUE(b.SendJson({{"type", "stopping"}, {"step", 4}, {"snapshot", true}}));
  ASSERT_TRUE(b.SendJson({{"type", "returned"}, {"round", 3}}));
  ASSERT_TRUE(b.SendJson({{"type", "committed"}, {"step", 9}}));   // all read after this
  ASSERT_TRUE(WaitUntil([&] { return server_->newest_step() == std::optional<int64_t>(9); }));
  EXPECT_EQ(channel.ReturnedRanks(3), std::vector<int>{1});
}

TEST_F(ControlServerTest, HelloFromAnOldRoundIsToldToStop) {
  ControlConn c(server_->path());
  ASSERT_TRUE(c.SendJson(
      {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 2}}));
  json reply = c.ReadJson();
  EXPECT_EQ(reply["type"], "stop");
  EXPECT_EQ(reply["round"], 2);
  EXPECT_FALSE(server_->IsConnected(3, 0));
}

TEST_F(ControlServerTest, RestoreQueryAnswersTheNewestReportedStep) {
  ControlConn c(server_->path());
  ASSERT_TRUE(c.SendJson({{"type", "query"}, {"id", 7}, {"what", "restore"}}));
  json reply = c.ReadJson();
  EXPECT_EQ(reply["id"], 7);
  EXPECT_TRUE(reply["restore_step"].is_null());
  ASSERT_TRUE(c.SendJson({{"type", "committed"}, {"step", 40}}));
  ASSERT_TRUE(c.SendJson({{"type", "committed"}, {"step", 30}}));
  ASSERT_TRUE(c.SendJson({{"type", "query"}, {"id", 8}, {"what", "restore"}}));
  reply = c.ReadJson();
  EXPECT_EQ(reply["id"], 8);
  EXPECT_EQ(reply["restore_step"], 40);
}

TEST_F(ControlServerTest, GarbageAndUnknownRequestsGetAnErrorAndKeepTheConnection) {
  ControlConn c(server_->path());
  ASSERT_TRUE(c.Send("this is not json\n"));
  EXPECT_EQ(c.ReadJson()["type"], "error");
  ASSERT_TRUE(c.SendJson({{"type", "frobnicate"}, {"id", 1}}));
  json reply = c.ReadJson();
  EXPECT_EQ(reply["type"], "error");
  EXPECT_EQ(reply["id"], 1);
  ASSERT_TRUE(c.SendJson(
      {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}}));
  EXPECT_EQ(c.ReadJson()["type"], "welcome");
}

TEST_F(ControlServerTest, FlushRequestIsQueuedAndAnsweredOnItsOwnConnection) {
  ControlConn a(server_->path());
  ControlConn b(server_->path());
  for (auto* c : {&a, &b}) {
    ASSERT_TRUE(c->SendJson(
        {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", c == &a ? 0 : 1},
         {"round", 3}}));
    ASSERT_EQ(c->ReadJson()["type"], "welcome");
  }
  ASSERT_TRUE(a.SendJson({{"type", "flush"}, {"id", 11}, {"scope", "node"}, {"timeout_ms", 2500}}));
  ASSERT_TRUE(b.SendJson({{"type", "flush"}, {"id", "x"}, {"scope", "rank12"}}));
  std::vector<FlushRequest> taken;
  ASSERT_TRUE(WaitUntil([&] {
    for (auto& r : server_->TakeFlushRequests()) taken.push_back(r);
    return taken.size() == 2;
  }));
  const FlushRequest* ra = taken[0].local_rank == 0 ? &taken[0] : &taken[1];
  const FlushRequest* rb = ra == &taken[0] ? &taken[1] : &taken[0];
  EXPECT_EQ(ra->scope, "node");
  EXPECT_EQ(ra->timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(rb->scope, "rank12");
  EXPECT_EQ(rb->timeout, std::chrono::minutes(10)) << "no timeout: the longest allowed";
  EXPECT_TRUE(server_->TakeFlushRequests().empty()) << "taken once";
  server_->AnswerFlush(*rb, Status::IOError("disk full"), false);
  server_->AnswerFlush(*ra, Status::OK(), true);
  json ans_a = a.ReadJson();
  EXPECT_EQ(ans_a["type"], "reply");
  EXPECT_EQ(ans_a["id"], 11);
  EXPECT_EQ(ans_a["persisted"], true);
  json ans_b = b.ReadJson();
  EXPECT_EQ(ans_b["type"], "error");
  EXPECT_EQ(ans_b["id"], "x");
  EXPECT_EQ(ans_b["message"], "disk full");
}

TEST_F(ControlServerTest, FlushWithoutHelloOrWithABadScopeGetsAnError) {
  ControlConn c(server_->path());
  ASSERT_TRUE(c.SendJson({{"type", "flush"}, {"id", 1}, {"scope", "node"}}));
  json reply = c.ReadJson();
  EXPECT_EQ(reply["type"], "error");
  EXPECT_EQ(reply["id"], 1);
  ASSERT_TRUE(c.SendJson(
      {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}}));
  ASSERT_EQ(c.ReadJson()["type"], "welcome");
  for (const char* scope : {"", "rank", "rank1x", "../etc", "node2"}) {
    ASSERT_TRUE(c.SendJson({{"type", "flush"}, {"id", 2}, {"scope", scope}}));
    reply = c.ReadJson();
    EXPECT_EQ(reply["type"], "error") << scope;
    EXPECT_NE(reply["message"].get<std::string>().find("scope"), std::string::npos) << scope;
  }
  EXPECT_TRUE(server_->TakeFlushRequests().empty());
}

TEST_F(ControlServerTest, FlushAnswerToAWorkerThatLeftIsDropped) {
  FlushRequest request;
  {
    ControlConn c(server_->path());
    ASSERT_TRUE(c.SendJson(
        {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}}));
    ASSERT_EQ(c.ReadJson()["type"], "welcome");
    ASSERT_TRUE(c.SendJson({{"type", "flush"}, {"id", 5}, {"scope", "node"}}));
    ASSERT_TRUE(WaitUntil([&] {
      auto r = server_->TakeFlushRequests();
      if (!r.empty()) request = r.front();
      return !r.empty();
    }));
  }
  ASSERT_TRUE(WaitUntil([&] { return !server_->IsConnected(3, 0); }));
  ControlConn next(server_->path());  // may get the same fd: must not get the old answer
  ASSERT_TRUE(next.SendJson(
      {{"type", "hello"}, {"pid", 2}, {"rank", 0}, {"local_rank", 0}, {"round", 3}}));
  ASSERT_EQ(next.ReadJson()["type"], "welcome");
  server_->AnswerFlush(request, Status::OK(), true);
  EXPECT_EQ(next.ReadLine(std::chrono::milliseconds(300)), "<timeout>");
}

TEST_F(ControlServerTest, DisconnectedWorkerIsForgotten) {
  {
    ControlConn c(server_->path());
    ASSERT_TRUE(c.SendJson(
        {{"type", "hello"}, {"pid", 1}, {"rank", 0}, {"local_rank", 0}, {"round", 3}}));
    EXPECT_EQ(c.ReadJson()["type"], "welcome");
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
