// Control-socket input a worker (or anything else running as the job's user) may send that is
// not what docs/control-protocol.md describes: each gets an error reply or a closed connection,
// and the server goes on serving everyone else.

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "agent/control_server.h"
#include "common/net.h"
#include "control_conn.h"

namespace efdl::agent {
namespace {

using nlohmann::json;
using testing::ControlConn;

class ControlBadInputTest : public testing::ControlServerFixture {
 protected:
  // A well-formed hello on a fresh connection is still welcomed: the server lives on.
  void ExpectServerStillServes() {
    ControlConn c(server_->path());
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(c.Send(R"({"type":"hello","pid":1,"rank":0,"local_rank":0,"round":3})"
                       "\n"));
    json reply = json::parse(c.ReadLine(), nullptr, false);
    EXPECT_EQ(reply.value("type", ""), "welcome");
  }
};

TEST_F(ControlBadInputTest, MalformedLinesGetAnErrorReplyEach) {
  const std::vector<std::string> lines = {
      "not json",
      "{\"type\":\"hello\"",                    // truncated object
      "[1,2,3]",                                // JSON, not an object
      "42",
      std::string("\x00\x01\xff\xfe garbage", 13),  // NUL and invalid UTF-8
      "{\"type\":5}",                           // type of the wrong type
      "{\"type\":\"\xff\xfe\"}",                // invalid UTF-8 inside a string
      "{\"type\":\"query\",\"what\":7}",        // a query for nothing known
      "{\"type\":\"nonsense\",\"id\":{\"deep\":[1,2,3]}}",
  };
  ControlConn c(server_->path());
  ASSERT_TRUE(c.connected());
  for (const auto& line : lines) {
    ASSERT_TRUE(c.Send(line + "\n"));
    std::string reply_text = c.ReadLine();
    json reply = json::parse(reply_text, nullptr, false);
    ASSERT_TRUE(reply.is_object()) << "input '" << line << "' got '" << reply_text << "'";
    EXPECT_EQ(reply.value("type", ""), "error") << line;
    EXPECT_FALSE(reply.value("message", "").empty()) << line;
  }
  ExpectServerStillServes();
}

TEST_F(ControlBadInputTest, WrongFieldTypesAreIgnoredNotTrusted) {
  ControlConn c(server_->path());
  // A hello whose round is not a number is a hello from no round: it is told to stop.
  ASSERT_TRUE(c.Send(R"({"type":"hello","pid":"x","rank":[],"local_rank":{},"round":"3"})"
                     "\n"));
  json reply = json::parse(c.ReadLine(), nullptr, false);
  EXPECT_EQ(reply.value("type", ""), "stop");
  // Steps that are not non-negative integers do not move the newest step.
  ASSERT_TRUE(c.Send("{\"type\":\"committed\",\"step\":\"99\"}\n"
                     "{\"type\":\"committed\",\"step\":-5}\n"
                     "{\"type\":\"committed\",\"step\":1.5}\n"
                     "{\"type\":\"committed\",\"step\":1e400}\n"));
  ASSERT_TRUE(c.Send("{\"type\":\"query\",\"what\":\"restore\",\"id\":1}\n"));
  std::string line = c.ReadLine();
  // 1e400 is not JSON a parser accepts: that line got an error reply before the query's.
  if (json::parse(line, nullptr, false).value("type", "") == "error") line = c.ReadLine();
  reply = json::parse(line, nullptr, false);
  EXPECT_EQ(reply.value("type", ""), "reply") << line;
  EXPECT_TRUE(reply.contains("restore_step") && reply["restore_step"].is_null()) << line;
  EXPECT_FALSE(server_->newest_step().has_value());
  ExpectServerStillServes();
}

TEST_F(ControlBadInputTest, OversizedLineGetsAnErrorAndTheConnectionIsClosed) {
  ControlConn c(server_->path());
  ASSERT_TRUE(c.connected());
  // 1 MiB without a newline; the server may close before it has read all of it.
  static_cast<void>(c.Send(std::string(1 << 20, 'x')));
  json reply = json::parse(c.ReadLine(), nullptr, false);
  EXPECT_EQ(reply.value("type", ""), "error");
  EXPECT_NE(reply.value("message", "").find("longer than"), std::string::npos);
  EXPECT_EQ(c.ReadLine(), "");  // then EOF
  ExpectServerStillServes();
}

TEST_F(ControlBadInputTest, TruncatedLineAtDisconnectIsDropped) {
  {
    ControlConn c(server_->path());
    ASSERT_TRUE(c.Send(R"({"type":"committed","step":12)"));  // no closing brace, no newline
    c.CloseWrite();
    EXPECT_EQ(c.ReadLine(), "");  // the server closes its end without a reply
  }
  EXPECT_FALSE(server_->newest_step().has_value());
  ExpectServerStillServes();
}

TEST_F(ControlBadInputTest, ManyConnectionsThatSendNothingDoNotBlockOthers) {
  std::vector<std::unique_ptr<ControlConn>> idle;
  for (int i = 0; i < 50; ++i) idle.push_back(std::make_unique<ControlConn>(server_->path()));
  ExpectServerStillServes();
}

}  // namespace
}  // namespace efdl::agent
