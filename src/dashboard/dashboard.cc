#include "dashboard/dashboard.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

namespace efdl::dashboard {

extern const char kPageHtml[];   // page_html.cc, generated from page.html

const std::string& PageHtml() {
  static const std::string page(kPageHtml);
  return page;
}

namespace {

constexpr size_t kMaxMetricsBytes = 4 << 20;
constexpr double kRetryFailedTargetS = 5;
constexpr size_t kScrapeThreads = 16;

double WallNow() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

NodeScrape Scrape(const std::string& node, const std::string& target, int timeout_ms) {
  NodeScrape s;
  s.node = node;
  s.target = target;
  auto body = HttpGet(target, "/metrics", timeout_ms, kMaxMetricsBytes);
  if (!body.ok()) {
    s.error = body.status().message();
    return s;
  }
  auto samples = ParseMetricsText(*body);
  if (!samples.ok()) {
    s.error = samples.status().message();
    return s;
  }
  s.ok = true;
  s.metrics = ExtractNodeMetrics(*samples);
  return s;
}

}  // namespace

Dashboard::Dashboard(DashboardOptions options, std::unique_ptr<etcd::Client> client)
    : options_(std::move(options)), client_(std::move(client)),
      state_(options_.job_id, options_.etcd) {}

Result<std::unique_ptr<Dashboard>> Dashboard::Start(const DashboardOptions& options,
                                                    std::unique_ptr<etcd::Client> client) {
  std::unique_ptr<Dashboard> d(new Dashboard(options, std::move(client)));
  d->PollOnce();
  auto server = HttpServer::Start(options.bind, options.port,
                                  [self = d.get()](const std::string& path) {
                                    return self->Handle(path);
                                  });
  if (!server.ok()) return server.status();
  d->server_ = std::move(*server);
  d->poller_ = std::thread([self = d.get()] { self->Loop(); });
  return d;
}

Dashboard::~Dashboard() {
  server_.reset();   // no request reads the document any more
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (poller_.joinable()) poller_.join();
}

std::string Dashboard::StateJson() const {
  MutexLock lock(mu_);
  return json_;
}

void Dashboard::PollOnce() {
  const double now = WallNow();
  Result<rdzv::JobStatus> status = rdzv::ReadJobStatus(*client_, options_.job_id);
  // The nodes to scrape: every announced endpoint of a node whose lease lives.
  std::vector<std::pair<std::string, std::string>> targets;
  if (status.ok()) {
    for (const auto* list : {&status->members, &status->standbys, &status->waiting}) {
      for (const rdzv::NodeStatus& n : *list) {
        if (!n.metrics.empty() && n.state != "gone") targets.emplace_back(n.id, n.metrics);
      }
    }
  }
  std::vector<NodeScrape> scrapes(targets.size());
  std::vector<bool> tried(targets.size(), false);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < targets.size(); i = next++) {
      auto retry = retry_at_.find(targets[i].second);   // read-only while the workers run
      if (retry != retry_at_.end() && now < retry->second.first) {
        scrapes[i] = {targets[i].first, targets[i].second, false,
                      fmt::format("{} (tried again every {:.0f} s)", retry->second.second,
                                  kRetryFailedTargetS),
                      {}};
        continue;
      }
      tried[i] = true;
      scrapes[i] = Scrape(targets[i].first, targets[i].second, options_.scrape_timeout_ms);
    }
  };
  // A dead host can hold a scrape for its whole timeout: scrape the nodes side by side.
  std::vector<std::thread> workers;
  for (size_t i = 1; i < std::min(targets.size(), kScrapeThreads); ++i) workers.emplace_back(work);
  work();
  for (auto& t : workers) t.join();
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!tried[i]) continue;
    if (scrapes[i].ok) {
      retry_at_.erase(targets[i].second);
    } else {
      retry_at_[targets[i].second] = {WallNow() + kRetryFailedTargetS, scrapes[i].error};
    }
  }
  state_.Update(now, status, scrapes);
  // The goodput ledger: its records read again when they changed (one keys-only read of one
  // key tells), summarised at every poll. Not tried when etcd just failed (that failure is
  // shown already).
  if (status.ok()) {
    auto at = rdzv::LedgerFingerprint(*client_, options_.job_id);
    if (!at.ok()) {
      state_.UpdateLedger(at.status());
    } else if (!ledger_ || *at != ledger_at_) {
      auto records = rdzv::ReadLedgerRecords(*client_, options_.job_id);
      if (records.ok()) {
        ledger_ = std::move(records).value();
        ledger_at_ = *at;
      } else {
        state_.UpdateLedger(records.status());
      }
    }
    if (at.ok() && ledger_) state_.UpdateLedger(rdzv::Summarize(ledger_->parts, ledger_->ends, now));
  }
  std::string json = state_.ToJson();
  MutexLock lock(mu_);
  json_ = std::move(json);
}

void Dashboard::Loop() {
  const auto interval = std::chrono::duration<double>(options_.poll_interval_s);
  while (true) {
    {
      MutexLock lock(mu_);
      if (wake_.wait_for(lock, interval, [this]() EFDL_REQUIRES(mu_) { return stopping_; })) {
        return;
      }
    }
    PollOnce();
  }
}

HttpResponse Dashboard::Handle(const std::string& path) const {
  if (path == "/" || path == "/index.html") {
    return {200, "text/html; charset=utf-8", PageHtml()};
  }
  if (path == "/api/state") return {200, "application/json", StateJson()};
  return {404, "text/plain; charset=utf-8",
          fmt::format("not found: {} (the page is /, its data /api/state)\n", path)};
}

}  // namespace efdl::dashboard
