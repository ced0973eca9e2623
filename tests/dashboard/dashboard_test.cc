#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "dashboard/dashboard.h"
#include "dashboard/dashboard_state.h"
#include "dashboard/http.h"
#include "dashboard/metrics_text.h"
#include "dashboard/throughput.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/ledger.h"
#include "support/memory_etcd.h"

namespace efdl::dashboard {
namespace {

using nlohmann::json;

TEST(MetricsTextTest, ReadsSamplesLabelsEscapesAndSpecialValues) {
  auto s = ParseMetricsText(
      "# HELP efdl_rank_step The step\n"
      "# TYPE efdl_rank_step gauge\n"
      "efdl_rank_step{efdl_job=\"j\",efdl_node=\"n\\\"1\\\\x\\n\",rank=\"3\"} 120\n"
      "\n"
      "efdl_world_size{efdl_job=\"j\"} 3 1700000000000\r\n"
      "efdl_pause_seconds_bucket{le=\"+Inf\",} +Inf\n"
      "nan_metric NaN\n"
      "no_labels -1.5e3\n");
  ASSERT_TRUE(s.ok()) << s.status().message();
  ASSERT_EQ(s->size(), 5u);
  EXPECT_EQ((*s)[0].name, "efdl_rank_step");
  EXPECT_EQ((*s)[0].labels.at("efdl_node"), "n\"1\\x\n");
  EXPECT_EQ((*s)[0].labels.at("rank"), "3");
  EXPECT_EQ((*s)[0].value, 120);
  EXPECT_EQ((*s)[1].value, 3) << "the timestamp is not the value";
  EXPECT_TRUE(std::isinf((*s)[2].value));
  EXPECT_EQ((*s)[2].labels.at("le"), "+Inf");
  EXPECT_TRUE(std::isnan((*s)[3].value));
  EXPECT_EQ((*s)[4].value, -1500);
}

TEST(MetricsTextTest, AMalformedLineIsAnErrorNamingIt) {
  for (const char* bad : {"ok 1\nbroken{rank=\"1\" 2\n", "ok 1\nm{rank=1} 2\n",
                          "ok 1\nm{rank=\"1\"} two\n", "ok 1\n{rank=\"1\"} 2\n",
                          "ok 1\nm{rank=\"1} 2\n"}) {
    auto s = ParseMetricsText(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("metrics line 2"), std::string::npos)
        << s.status().message();
  }
}

// A node's metrics say `round`, `world` and, in rank order, these (rank, step) pairs.
void ExpectNode(const NodeMetrics& m, int64_t round, int world,
                const std::vector<RankStep>& ranks) {
  EXPECT_EQ(m.round, round);
  EXPECT_EQ(m.world_size, world);
  ASSERT_EQ(m.ranks.size(), ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    EXPECT_EQ(m.ranks[i].rank, ranks[i].rank) << i;
    EXPECT_EQ(m.ranks[i].step, ranks[i].step) << i;
  }
}

TEST(MetricsTextTest, ExtractsRanksRoundAndWorldSizeSkippingUnknownSteps) {
  auto s = ParseMetricsText(
      "efdl_round{a=\"b\"} 4\nefdl_world_size 2\n"
      "efdl_rank_step{rank=\"1\"} 7\nefdl_rank_step{rank=\"0\"} 9\n"
      "efdl_rank_step{rank=\"2\"} -1\nefdl_rank_step{norank=\"x\"} 5\n"
      "efdl_rank_step_seconds{rank=\"0\"} 0.1\n");
  ASSERT_TRUE(s.ok());
  ExpectNode(ExtractNodeMetrics(*s), 4, 2, {{0, 9}, {1, 7}});
}

// The reader against what a real agent endpoint serves (prometheus-cpp's exposition), fetched
// with the dashboard's own HTTP client.
TEST(MetricsTextTest, ReadsARealAgentEndpoint) {
  auto started = metrics::AgentMetrics::Start({metrics::Listen::Mode::kPort, 0}, "job-a", "n1");
  ASSERT_TRUE(started.ok()) << started.status().message();
  metrics::AgentMetrics& m = **started;
  m.SetRound(5, 3, 2, 2, false);
  m.SetRankProgress({{0, 41, 0.1, 0.05}, {2, 40, 0.1, 0.07}});
  auto body = HttpGet("127.0.0.1:" + std::to_string(m.port()), "/metrics", 2000, 1 << 20);
  ASSERT_TRUE(body.ok()) << body.status().message();
  auto samples = ParseMetricsText(*body);
  ASSERT_TRUE(samples.ok()) << samples.status().message() << "\n" << *body;
  ExpectNode(ExtractNodeMetrics(*samples), 5, 3, {{0, 41}, {2, 40}});
}

TEST(ThroughputTest, RatesFromStepDeltasOverTheWindowOnAFakeClock) {
  ThroughputHistory h(/*rate_window_s=*/5, /*window_s=*/60, /*max_points=*/1000);
  double t = 1000;
  // Two ranks at 10 and 5 steps/s, read once a second.
  for (int i = 0; i <= 10; ++i) {
    h.Observe(t + i, {{"a", 0, 10 * i}, {"b", 1, 5 * i}}, 1, 2);
    if (i == 0) {
      EXPECT_EQ(*h.RankRate("a", 0), 0) << "one reading has no rate yet";
    }
  }
  EXPECT_DOUBLE_EQ(*h.RankRate("a", 0), 10);
  EXPECT_DOUBLE_EQ(*h.RankRate("b", 1), 5);
  const ThroughputPoint& p = h.points().back();
  EXPECT_DOUBLE_EQ(p.rank_steps_per_s, 15);
  EXPECT_DOUBLE_EQ(p.job_steps_per_s, 7.5) << "the median of two rates";
  EXPECT_EQ(p.ranks, 2);
  EXPECT_EQ(p.world_size, 2);
  // A pause: the steps stand still; the rate falls to 0 once the window holds only the pause.
  for (int i = 11; i <= 16; ++i) h.Observe(t + i, {{"a", 0, 100}, {"b", 1, 50}}, 1, 2);
  EXPECT_DOUBLE_EQ(*h.RankRate("a", 0), 0);
  EXPECT_DOUBLE_EQ(h.points().back().rank_steps_per_s, 0);
  // A new round resumes from an earlier snapshot: the step goes back, no negative rate.
  h.Observe(t + 17, {{"a", 0, 96}}, 2, 1);
  EXPECT_DOUBLE_EQ(*h.RankRate("a", 0), 0);
  EXPECT_FALSE(h.RankRate("b", 1).has_value()) << "a rank not read any more is forgotten";
  h.Observe(t + 18, {{"a", 0, 108}}, 2, 1);
  EXPECT_DOUBLE_EQ(*h.RankRate("a", 0), 12);
  EXPECT_EQ(h.points().back().round, 2);
  EXPECT_EQ(h.points().back().ranks, 1);
  // The timeline is bounded by its window.
  h.Observe(t + 100, {{"a", 0, 108}}, 2, 1);
  for (const ThroughputPoint& q : h.points()) EXPECT_GE(q.t, t + 100 - 60);
}

TEST(ThroughputTest, TheTimelineIsBoundedInPoints) {
  ThroughputHistory h(5, 1e9, 50);
  for (int i = 0; i < 200; ++i) h.Observe(i, {{"a", 0, i}}, 1, 1);
  EXPECT_EQ(h.points().size(), 50u);
  EXPECT_EQ(h.points().front().t, 150);
}

TEST(IsoTimeTest, ParsesAndFormatsTheLogTimestamps) {
  auto t = ParseIsoTime("2026-12-06T05:50:58.123Z");
  ASSERT_TRUE(t.has_value());
  EXPECT_NEAR(*t, 1796536258.123, 1e-6);
  EXPECT_EQ(FormatIsoTime(*t), "2026-12-06T05:50:58.123Z");
  EXPECT_TRUE(ParseIsoTime("2026-12-06T05:50:58Z").has_value());
  EXPECT_FALSE(ParseIsoTime("yesterday").has_value());
  EXPECT_FALSE(ParseIsoTime("2026-12-06 05:50:58").has_value());
}

rdzv::JobStatus Job(int64_t round, int world, std::vector<rdzv::JobEvent> events) {
  rdzv::JobStatus s;
  s.job_id = "j1";
  s.exists = true;
  s.round = round;
  s.phase = "active";
  s.world_size = world;
  s.nnodes = world;
  rdzv::NodeStatus a;
  a.id = "node-a";
  a.state = "member";
  a.node_rank = 0;
  a.metrics = "127.0.0.1:1";
  s.members.push_back(a);
  s.events = std::move(events);
  return s;
}

NodeScrape Scraped(const std::string& node, int rank, int64_t step) {
  NodeScrape s;
  s.node = node;
  s.target = "127.0.0.1:1";
  s.ok = true;
  s.metrics.ranks = {{rank, step}};
  return s;
}

TEST(DashboardStateTest, TheDocumentCarriesStatusScrapesThroughputAndEveryEventSeen) {
  DashboardState st("j1", "127.0.0.1:2379");
  const double t0 = *ParseIsoTime("2026-12-06T06:00:00.000Z");
  st.Update(t0, Job(3, 2, {{"2026-12-06T05:59:58.000Z", "proposing round 3: node-b joined"}}),
            {Scraped("node-a", 0, 100)});
  st.Update(t0 + 1, Job(3, 2, {{"2026-12-06T05:59:58.000Z", "proposing round 3: node-b joined"}}),
            {Scraped("node-a", 0, 110)});
  // The coordinator changed: its status record starts a new event list; the old event stays.
  st.Update(t0 + 2, Job(4, 1, {{"2026-12-06T06:00:01.500Z", "proposing round 4: node-b lost"}}),
            {Scraped("node-a", 0, 118)});
  NodeScrape down;
  down.node = "node-b";
  down.target = "127.0.0.1:2";
  down.error = "cannot connect";
  st.Update(t0 + 3, Job(4, 1, {}), {Scraped("node-a", 0, 128), down});

  json j = json::parse(st.ToJson());
  EXPECT_EQ(j["job"], "j1");
  EXPECT_EQ(j["etcd"], "127.0.0.1:2379");
  EXPECT_EQ(j["polls"], 4);
  EXPECT_EQ(j["etcd_error"], "");
  EXPECT_DOUBLE_EQ(j["now"].get<double>(), t0 + 3);
  // The status object is efdl status --json's.
  EXPECT_EQ(j["status"], json::parse(Job(4, 1, {}).ToJson()));
  EXPECT_EQ(j["status"]["world_size"], 1);
  // Events: both status events (sorted by time) and the round change the dashboard saw.
  ASSERT_EQ(j["events"].size(), 3u) << j["events"].dump();
  EXPECT_EQ(j["events"][0]["message"], "proposing round 3: node-b joined");
  EXPECT_EQ(j["events"][0]["kind"], "event");
  EXPECT_DOUBLE_EQ(j["events"][0]["t"].get<double>(), t0 - 2);
  EXPECT_EQ(j["events"][1]["message"], "proposing round 4: node-b lost");
  EXPECT_EQ(j["events"][2]["kind"], "round");
  EXPECT_EQ(j["events"][2]["message"], "round 4: world size 1");
  EXPECT_DOUBLE_EQ(j["events"][2]["t"].get<double>(), t0 + 2);
  // Scrapes: node-a's rank with its rate, node-b's error.
  EXPECT_EQ(j["scrapes"]["node-a"]["ranks"][0]["step"], 128);
  EXPECT_NEAR(j["scrapes"]["node-a"]["ranks"][0]["steps_per_s"].get<double>(), 28.0 / 3, 1e-9);
  EXPECT_EQ(j["scrapes"]["node-b"]["ok"], false);
  EXPECT_EQ(j["scrapes"]["node-b"]["error"], "cannot connect");
  // Throughput: [t, rank_steps_per_s, job_steps_per_s, ranks, round, world_size] per poll.
  ASSERT_EQ(j["throughput"].size(), 4u);
  EXPECT_EQ(j["throughput"][1], json({t0 + 1, 10.0, 10.0, 1, 3, 2}));
  EXPECT_EQ(j["throughput"][3][4], 4);
  EXPECT_EQ(j["throughput"][3][5], 1);
}

TEST(DashboardStateTest, KeepsTheLastStatusWhenEtcdFailsAndSaysWhy) {
  DashboardState st("j1", "e:1");
  st.Update(10, Job(2, 2, {}), {});
  st.Update(11, Status::Unavailable("etcd is down"), {});
  json j = json::parse(st.ToJson());
  EXPECT_EQ(j["etcd_error"], "etcd is down");
  EXPECT_EQ(j["status"]["round"], 2);
  DashboardState none("nobody", "e:1");
  rdzv::JobStatus missing;
  missing.job_id = "nobody";
  none.Update(1, missing, {});
  j = json::parse(none.ToJson());
  EXPECT_EQ(j["status"]["exists"], false);
  EXPECT_EQ(j["throughput"][0][5], 0) << "no world without a job";
}

TEST(DashboardStateTest, AJobThatEndedHasWorldSizeZeroAndItsEndOnTheTimeline) {
  DashboardState st("j1", "e:1");
  st.Update(10, Job(2, 2, {}), {});
  rdzv::JobStatus done = Job(2, 2, {});
  done.complete = true;
  st.Update(11, done, {});
  json j = json::parse(st.ToJson());
  EXPECT_EQ(j["throughput"][1][5], 0);
  ASSERT_EQ(j["events"].size(), 1u) << j["events"].dump();
  EXPECT_EQ(j["events"][0]["message"], "round 2: complete");
  EXPECT_EQ(j["events"][0]["kind"], "round");
}

// The ledger parts of a 3-node job (rounds 1 and 2) that lost node c at 200.5 and trained again
// from 204; c wrote nothing for round 2.
std::vector<rdzv::LedgerPart> LedgerParts() {
  std::vector<rdzv::LedgerPart> v;
  for (const char* n : {"a", "b", "c"}) {
    rdzv::LedgerPart p;
    p.node = n;
    p.round = 1;
    p.world = p.nnodes = 3;
    p.why = "job started";
    p.start = 100;
    p.progress = 102;
    p.step = 1;
    p.step_s = 0.5;
    v.push_back(p);
  }
  for (const char* n : {"a", "b"}) {
    rdzv::LedgerPart p;
    p.node = n;
    p.round = 2;
    p.world = p.nnodes = 2;
    p.prev_world = p.prev_nnodes = 3;
    p.why = "node c is gone";
    p.sign = 200.5;
    p.start = 203;
    p.progress = 204;
    p.step = 37;
    p.prev_step = 40;
    p.prev_at = 200.4;
    p.step_s = 0.5;
    v.push_back(p);
  }
  return v;
}

TEST(DashboardStateTest, TheDocumentCarriesTheLedgerAndKeepsItWhenAReadFails) {
  DashboardState st("j1", "e:1");
  st.Update(210, Job(2, 2, {}), {});
  json j = json::parse(st.ToJson());
  EXPECT_TRUE(j["ledger"].is_null()) << "no ledger read yet";
  const rdzv::LedgerReport report = rdzv::Summarize(LedgerParts(), {}, /*now=*/210);
  st.UpdateLedger(report);
  j = json::parse(st.ToJson());
  // The ledger object is efdl events --json's.
  EXPECT_EQ(j["ledger"], json::parse(report.ToJson()));
  EXPECT_EQ(j["ledger_error"], "");
  EXPECT_DOUBLE_EQ(j["ledger"]["wall_s"].get<double>(), 110);
  EXPECT_NEAR(j["ledger"]["goodput"].get<double>(), report.totals.goodput(), 1e-12);
  EXPECT_GT(j["ledger"]["goodput"].get<double>(), 0);
  EXPECT_LT(j["ledger"]["goodput"].get<double>(), 1);
  double sum = 0;
  for (const char* c : {"startup", "training", "lost", "hung", "rendezvous", "restore",
                        "suspended"}) {
    ASSERT_TRUE(j["ledger"]["seconds"].contains(c)) << c;
    sum += j["ledger"]["seconds"][c].get<double>();
  }
  EXPECT_NEAR(sum, 110, 1e-9);
  ASSERT_EQ(j["ledger"]["events"].size(), 1u);
  const json& e = j["ledger"]["events"][0];
  EXPECT_EQ(e["kind"], "crash");
  EXPECT_EQ(e["round"], 2);
  EXPECT_EQ(e["world_before"], 3);
  EXPECT_EQ(e["world_after"], 2);
  EXPECT_DOUBLE_EQ(e["rendezvous_s"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(e["restore_s"].get<double>(), 1);
  EXPECT_EQ(e["steps_lost"], 4);
  // A failed read says why and keeps the last report.
  st.UpdateLedger(Status::Unavailable("etcd is down"));
  j = json::parse(st.ToJson());
  EXPECT_EQ(j["ledger_error"], "etcd is down");
  EXPECT_EQ(j["ledger"]["events"][0]["kind"], "crash");
}

// The real Dashboard reads the ledger from etcd (the in-memory one) at its first poll and each
// poll after; a job that ended keeps its ledger there, so the page shows it then too.
TEST(DashboardTest, ThePollerReadsTheLedgerFromEtcd) {
  auto etcd = std::make_unique<testing::MemoryEtcd>();
  for (const rdzv::LedgerPart& p : LedgerParts()) {
    ASSERT_TRUE(etcd->Put(rdzv::LedgerPartKey("j1", p.node, p.round), p.Encode()).ok());
  }
  testing::MemoryEtcd* raw = etcd.get();
  DashboardOptions o;
  o.job_id = "j1";
  o.etcd = "memory";
  o.port = 0;
  o.poll_interval_s = 0.05;
  auto d = Dashboard::Start(o, std::move(etcd));
  ASSERT_TRUE(d.ok()) << d.status().message();
  json j = json::parse((*d)->StateJson());
  ASSERT_FALSE(j["ledger"].is_null()) << j.dump();
  ASSERT_EQ(j["ledger"]["events"].size(), 1u) << j["ledger"].dump();
  EXPECT_EQ(j["ledger"]["events"][0]["kind"], "crash");
  EXPECT_FALSE(j["ledger"]["complete"]);
  // Polls that find the ledger unchanged read one key's name (its fingerprint), not the records:
  // a poll costs less than the records' bytes (a job of 128 nodes keeps thousands of them).
  int64_t ledger_bytes = 0;
  for (const rdzv::LedgerPart& p : LedgerParts()) ledger_bytes += p.Encode().size();
  const int64_t polls0 = j["polls"].get<int64_t>();
  const int64_t read0 = raw->stats().bytes_read;
  {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (json::parse((*d)->StateJson())["polls"].get<int64_t>() < polls0 + 6) {
      ASSERT_LT(std::chrono::steady_clock::now(), until);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  const int64_t polls = json::parse((*d)->StateJson())["polls"].get<int64_t>() - polls0;
  const int64_t per_poll = (raw->stats().bytes_read - read0) / std::max<int64_t>(1, polls - 1);
  EXPECT_LT(per_poll, ledger_bytes / 2) << per_poll << " bytes per poll, ledger " << ledger_bytes;
  // The nodes end the job: a later poll reads the end records.
  const rdzv::LedgerEnd end{"a", 2, 300, "complete"};
  ASSERT_TRUE(raw->Put(rdzv::LedgerEndKey("j1", "a"), end.Encode()).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!json::parse((*d)->StateJson())["ledger"]["complete"].get<bool>()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << (*d)->StateJson();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  j = json::parse((*d)->StateJson());
  EXPECT_DOUBLE_EQ(j["ledger"]["wall_s"].get<double>(), 200);
}

TEST(HttpServerTest, ServesTheHandlerAndTheClientReadsIt) {
  auto server = HttpServer::Start("127.0.0.1", 0, [](const std::string& path) {
    if (path == "/x") return HttpResponse{200, "text/plain", "hello " + path};
    return HttpResponse{404, "text/plain", "no"};
  });
  ASSERT_TRUE(server.ok()) << server.status().message();
  ASSERT_GT((*server)->port(), 0);
  const std::string target = "127.0.0.1:" + std::to_string((*server)->port());
  auto body = HttpGet(target, "/x", 2000, 1024);
  ASSERT_TRUE(body.ok()) << body.status().message();
  EXPECT_EQ(*body, "hello /x");
  auto missing = HttpGet(target, "/y", 2000, 1024);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("answered 404"), std::string::npos);
  auto big = HttpGet(target, "/x", 2000, 3);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("more than 3 bytes"), std::string::npos);
  // The same port again: one error line naming the address.
  auto taken = HttpServer::Start("127.0.0.1", (*server)->port(),
                                 [](const std::string&) { return HttpResponse{}; });
  ASSERT_FALSE(taken.ok());
  EXPECT_NE(taken.status().message().find("cannot listen on 127.0.0.1:" + target.substr(10)),
            std::string::npos)
      << taken.status().message();
  const int port = (*server)->port();
  server->reset();
  auto gone = HttpGet("127.0.0.1:" + std::to_string(port), "/x", 2000, 1024);
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.status().message().find("cannot connect to 127.0.0.1:" + std::to_string(port) + ": "), std::string::npos)
      << gone.status().message();
}

// A node whose endpoint accepts connections but never answers (a stopped process): the scrape
// fails after its timeout instead of holding the poll.
TEST(HttpGetTest, AnEndpointThatNeverAnswersFailsWithinTheTimeout) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);   // the kernel completes the handshake; nobody reads
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const auto start = std::chrono::steady_clock::now();
  auto r = HttpGet("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), "/metrics", 500, 1024);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(fd);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no answer from"), std::string::npos)
      << r.status().message();
  EXPECT_GE(took, 0.4);
  EXPECT_LT(took, 3.0);
}

TEST(HttpGetTest, RefusesATargetThatIsNotHostPort) {
  for (const char* bad : {"nohost", "h:", "h:0", "h:99999", "h:12x"}) {
    auto r = HttpGet(bad, "/metrics", 100, 10);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not HOST:PORT"), std::string::npos) << bad;
  }
}

TEST(PageTest, TheEmbeddedPageIsSelfContainedAndPollsTheDocument) {
  const std::string& page = PageHtml();
  EXPECT_NE(page.find("<!DOCTYPE html>"), std::string::npos);
  EXPECT_NE(page.find("fetch(\"/api/state\""), std::string::npos);
  EXPECT_NE(page.find("id=\"world-size\""), std::string::npos);
  // Nothing from elsewhere: no script or style source, no absolute URL but the SVG namespace.
  for (const char* outside : {"src=", "href=", "@import", "https://", "//cdn"}) {
    EXPECT_EQ(page.find(outside), std::string::npos) << outside;
  }
  size_t http = page.find("http://");
  EXPECT_EQ(page.substr(http, 26), "http://www.w3.org/2000/svg");
  EXPECT_EQ(page.find("http://", http + 1), std::string::npos);
}

}  // namespace
}  // namespace efdl::dashboard
