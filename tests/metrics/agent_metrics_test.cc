#include "metrics/agent_metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace efdl::metrics {
namespace {

// GET /metrics from 127.0.0.1:port; the whole answer (headers and body), "" when no connection.
std::string Scrape(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, n);
    }
  }
  ::close(fd);
  return out;
}

TEST(MetricsListenTest, ParsesAutoOffAndPortsAndRefusesTheRest) {
  EXPECT_EQ(ParseListen("auto")->mode, Listen::Mode::kAuto);
  EXPECT_EQ(ParseListen("")->mode, Listen::Mode::kAuto);
  EXPECT_EQ(ParseListen("off")->mode, Listen::Mode::kOff);
  auto p = ParseListen("9500");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->mode, Listen::Mode::kPort);
  EXPECT_EQ(p->port, 9500);
  EXPECT_EQ(ParseListen("0")->port, 0);
  for (const char* bad : {"-1", "65536", "90x", "on", " 9000"}) {
    auto r = ParseListen(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--metrics-port"), std::string::npos);
    EXPECT_NE(r.status().message().find("'off'"), std::string::npos) << "says what to give";
  }
}

TEST(AgentMetricsTest, OffStartsNothing) {
  auto m = AgentMetrics::Start({Listen::Mode::kOff, 0}, "j", "n");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(*m, nullptr);
}

TEST(AgentMetricsTest, ServesTheJobsSeriesWithItsLabelsOverHttp) {
  auto started = AgentMetrics::Start({Listen::Mode::kPort, 0}, "job-a", "node-1");
  ASSERT_TRUE(started.ok()) << started.status().message();
  AgentMetrics& m = **started;
  ASSERT_GT(m.port(), 0);
  m.SetRound(4, 6, 3, 2, /*standby=*/false);
  m.CountRoundChange(/*graceful=*/false);
  m.CountWorkerFailure(/*own=*/true);
  m.CountRestarts(1);
  m.CountWorkerFailure(/*own=*/false);
  m.CountHang(/*own=*/true);
  m.ObservePause("rendezvous", 0.4);
  m.ObservePause("resume", 1.5);
  m.SetRankProgress({{2, 17, 0.25, 0.1}, {3, 17, 0.3, 0.2}});
  m.ObservePersist(0.02, 4096, 1000.0);
  m.UpdateSnapshotAge(1003.5);
  m.OnCall("put", 0.003, true);
  m.OnCall("put", 0.2, false);
  m.OnLeaseRenewalFailed("late");
  m.SetGoodput(true, 0.75, {{"training", 30.0}, {"rendezvous", 10.0}});
  const std::string text = Scrape(m.port());
  ASSERT_NE(text.find("200 OK"), std::string::npos) << text;
  const std::string ids = "efdl_job=\"job-a\",efdl_node=\"node-1\"";
  for (const std::string& line : {
           "efdl_round{" + ids + "} 4",
           "efdl_world_size{" + ids + "} 6",
           "efdl_nodes{" + ids + "} 3",
           "efdl_local_workers{" + ids + "} 2",
           "efdl_round_changes_total{" + ids + ",graceful=\"false\"} 1",
           "efdl_worker_failures_total{" + ids + ",blame=\"collateral\"} 1",
           "efdl_worker_failures_total{" + ids + ",blame=\"own\"} 1",
           "efdl_restarts_total{" + ids + "} 1",
           "efdl_hangs_total{" + ids + ",blame=\"own\"} 1",
           "efdl_pause_seconds_count{" + ids + ",phase=\"resume\"} 1",
           "efdl_pause_seconds_sum{" + ids + ",phase=\"rendezvous\"} 0.4",
           "efdl_rank_step{" + ids + ",rank=\"3\"} 17",
           "efdl_rank_step_seconds{" + ids + ",rank=\"2\"} 0.25",
           "efdl_persisted_bytes_total{" + ids + "} 4096",
           "efdl_snapshot_age_seconds{" + ids + "} 3.5",
           "efdl_etcd_request_seconds_count{" + ids + ",operation=\"put\"} 2",
           "efdl_etcd_request_errors_total{" + ids + ",operation=\"put\"} 1",
           "efdl_lease_renewals_failed_total{" + ids + ",outcome=\"late\"} 1",
           "efdl_goodput_ratio{" + ids + "} 0.75",
           "efdl_job_seconds{" + ids + ",category=\"training\"} 30",
       }) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << "missing: " << line << "\n" << text;
  }
  // A rank of an earlier round is dropped, not left frozen at its last value; so is the
  // goodput of a node that is no longer node rank 0.
  m.SetRankProgress({{0, 20, 0.2, 0.0}});
  m.SetGoodput(false, 0, {});
  const std::string later = Scrape(m.port());
  EXPECT_EQ(later.find("efdl_goodput_ratio{"), std::string::npos) << later;
  EXPECT_EQ(later.find("efdl_job_seconds{"), std::string::npos) << later;
  EXPECT_EQ(later.find("rank=\"3\""), std::string::npos) << later;
  EXPECT_NE(later.find("efdl_rank_step{" + ids + ",rank=\"0\"} 20\n"), std::string::npos);
}

TEST(AgentMetricsTest, AFixedPortThatIsTakenIsOneClearErrorAndAutoMovesOn) {
  auto first = AgentMetrics::Start({Listen::Mode::kPort, 0}, "j", "a");
  ASSERT_TRUE(first.ok());
  const int taken = (*first)->port();
  auto second = AgentMetrics::Start({Listen::Mode::kPort, taken}, "j", "b");
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(std::to_string(taken)), std::string::npos);
  EXPECT_NE(second.status().message().find("--metrics-port"), std::string::npos);
  // Two agents on one host with the default: the second takes the next free port of the range.
  auto a = AgentMetrics::Start({}, "j", "a");
  auto b = AgentMetrics::Start({}, "j", "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->port(), (*b)->port());
  EXPECT_GE((*b)->port(), kDefaultPort);
  EXPECT_LT((*b)->port(), kDefaultPort + kAutoRange);
  EXPECT_NE(Scrape((*b)->port()).find("efdl_node=\"b\""), std::string::npos);
}

}  // namespace
}  // namespace efdl::metrics
