#include "horovod/http.h"

#include <gtest/gtest.h>

namespace efdl::horovod {
namespace {

using State = HttpRequestParser::State;
using namespace std::string_literals;

HttpRequestParser Parser() { return HttpRequestParser(1024, 4096); }

TEST(HttpParserTest, ParsesPutBodyFedByteByByte) {
  std::string raw = "PUT /global/rank_0 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab\0\r\n"s;
  auto p = Parser();
  for (size_t i = 0; i + 1 < raw.size(); ++i) {
    ASSERT_EQ(p.Feed(raw.substr(i, 1)), State::kIncomplete) << "at byte " << i;
  }
  ASSERT_EQ(p.Feed(raw.substr(raw.size() - 1)), State::kComplete);
  EXPECT_EQ(p.request().method, "PUT");
  EXPECT_EQ(p.request().target, "/global/rank_0");
  EXPECT_EQ(p.request().body, std::string("ab\0\r\n", 5));
  EXPECT_EQ(p.request().Header("host"), "x");
}

TEST(HttpParserTest, GetWithoutBodyCompletesAtBlankLine) {
  auto p = Parser();
  EXPECT_EQ(p.Feed("GET /a/b HTTP/1.0\n\n"), State::kComplete);  // bare LF accepted
  EXPECT_EQ(p.request().minor_version, 0);
  EXPECT_TRUE(p.request().body.empty());
}

TEST(HttpParserTest, RejectsMalformedInputWithStatus) {
  struct Case {
    std::string raw;
    int status;
  };
  std::vector<Case> cases = {
      {"garbage\r\n\r\n", 400},
      {"GET  /a/b HTTP/1.1\r\n\r\n", 400},
      {"GET a/b HTTP/1.1\r\n\r\n", 400},
      {"GET /a/b HTTP/2.0\r\n\r\n", 505},
      {"GET /a/b FTP/1.0\r\n\r\n", 400},
      {"G(T /a/b HTTP/1.1\r\n\r\n", 400},
      {"GET /a/b HTTP/1.1\r\nno colon\r\n\r\n", 400},
      {"GET /a/b HTTP/1.1\r\nBad Name: v\r\n\r\n", 400},
      {"GET /a/b HTTP/1.1\r\nX: 1\r\n folded\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400},
      {"PUT /a/b HTTP/1.1\r\n\r\n", 411},
      {"PUT /a/b HTTP/1.1\r\nContent-Length: 4097\r\n\r\n", 413},
      {"PUT /a/b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501},
      {"GET /" + std::string(2000, 'a') + " HTTP/1.1\r\n\r\n", 431},
      {"GET /" + std::string(2000, 'a'), 431},  // no end of head in sight
  };
  for (const auto& c : cases) {
    auto p = Parser();
    EXPECT_EQ(p.Feed(c.raw), State::kError) << c.raw.substr(0, 60);
    EXPECT_EQ(p.error_status(), c.status) << c.raw.substr(0, 60);
    EXPECT_FALSE(p.error_message().empty());
    EXPECT_EQ(p.Feed("more"), State::kError);  // stays failed
  }
}

// The body of `raw`, which must parse as one complete request.
std::string BodyOfComplete(const std::string& raw) {
  auto p = Parser();
  EXPECT_EQ(p.Feed(raw), State::kComplete);
  return p.request().body;
}

TEST(HttpParserTest, SameContentLengthTwiceIsAccepted) {
  EXPECT_EQ(BodyOfComplete(
                "PUT /a/b HTTP/1.1\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\nhi"),
            "hi");
}

TEST(HttpParserTest, ExpectContinueIsReportedOnce) {
  auto p = Parser();
  EXPECT_EQ(p.Feed("PUT /a/b HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"),
            State::kIncomplete);
  EXPECT_TRUE(p.TakeContinueRequest());
  EXPECT_FALSE(p.TakeContinueRequest());
  EXPECT_EQ(p.Feed("xyz"), State::kComplete);
}

TEST(HttpParserTest, BytesAfterTheBodyAreIgnored) {
  EXPECT_EQ(BodyOfComplete(
                "PUT /a/b HTTP/1.1\r\nContent-Length: 2\r\n\r\nhiGET /x/y HTTP/1.1\r\n\r\n"),
            "hi");
}

TEST(HttpResponseTest, SerializesWithLengthAndClose) {
  HttpResponse r;
  r.status = 404;
  EXPECT_EQ(r.Serialize(), "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  r.status = 200;
  r.body = std::string("a\0b", 3);
  r.extra_headers.emplace_back("X-A", "1");
  EXPECT_EQ(r.Serialize(),
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\nX-A: 1\r\n\r\na\0b"s);
}

}  // namespace
}  // namespace efdl::horovod
