// `efdl dashboard`: one self-contained page (inline HTML, CSS, JS and SVG; nothing fetched from
// elsewhere) showing a job live, and the JSON document it polls (docs/operations.md
// "Dashboard"). The Dashboard owns a poller thread, which reads the job's status and its goodput
// ledger from etcd and scrapes its nodes' metrics endpoints every poll into a DashboardState,
// and an HttpServer whose threads only copy the latest document out. The destructor stops both.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/thread_annotations.h"
#include "dashboard/dashboard_state.h"
#include "dashboard/http.h"
#include "efdl/etcd.h"
#include "efdl/status.h"
#include "rendezvous/ledger.h"

namespace efdl::dashboard {

inline constexpr int kDefaultPort = 9440;

struct DashboardOptions {
  std::string job_id;
  std::string etcd;                 // as the user gave it (shown on the page)
  std::string bind = "127.0.0.1";
  int port = kDefaultPort;          // 0: any free port
  double poll_interval_s = 1.0;
  int scrape_timeout_ms = 2000;
};

// The page (src/dashboard/page.html, embedded at build time).
const std::string& PageHtml();

class Dashboard {
 public:
  // Polls once (so the first page load has data), then starts the server and the poller.
  static Result<std::unique_ptr<Dashboard>> Start(const DashboardOptions& options,
                                                  std::unique_ptr<etcd::Client> client);
  ~Dashboard();
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  int port() const { return server_->port(); }
  // The latest document (GET /api/state).
  std::string StateJson() const EFDL_EXCLUDES(mu_);

 private:
  Dashboard(DashboardOptions options, std::unique_ptr<etcd::Client> client);
  void PollOnce();
  void Loop();
  HttpResponse Handle(const std::string& path) const;

  const DashboardOptions options_;
  const std::unique_ptr<etcd::Client> client_;
  DashboardState state_;            // the poller's own (the poller thread, or Start before it)
  // Targets whose last scrape failed: not tried again before this wall time, and why it failed.
  std::map<std::string, std::pair<double, std::string>> retry_at_;
  // The ledger's records as last read, and the fingerprint they were read at: a poll reads
  // them again only when the fingerprint moved (a few keys per node and round; summarised
  // again at every poll for the running job's clock).
  std::optional<rdzv::LedgerRecords> ledger_;
  std::pair<int64_t, int64_t> ledger_at_{-1, -1};
  mutable Mutex mu_;
  std::string json_ EFDL_GUARDED_BY(mu_);
  bool stopping_ EFDL_GUARDED_BY(mu_) = false;
  std::condition_variable_any wake_;
  std::thread poller_;
  // Declared last: destroyed first, so no request runs once the rest goes.
  std::unique_ptr<HttpServer> server_;
};

}  // namespace efdl::dashboard
