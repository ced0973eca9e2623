// AgentMetrics: the Prometheus metrics one agent serves over HTTP (issue #33, docs/operations.md
// "Metrics"). The exposition (text format, HTTP server and its threads) is prometheus-cpp's; this
// class owns the registry, the metric families and the exposer, whose threads stop with it.
//
// Thread-safe: ObservePersist/CountPersistFailure come from the persister's threads; the rest from
// the agent's loop. Every series carries the labels `efdl_job` and `efdl_node` (not `job`/`instance`, which
// Prometheus sets itself from the scrape config). The agent's loop calls the setters; the
// exposer's threads only read (prometheus-cpp's metrics are atomic).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace efdl::metrics {

// Where the endpoint listens (`efdl run --metrics-port`, EFDL_METRICS_PORT).
struct Listen {
  enum class Mode {
    kOff,    // "off": no endpoint
    kAuto,   // "auto" (the default): kDefaultPort, or the next free one of kAutoRange ports
    kPort,   // a number: exactly that port (0: any free port the kernel picks)
  };
  Mode mode = Mode::kAuto;
  int port = 0;
};
inline constexpr int kDefaultPort = 9441;
inline constexpr int kAutoRange = 32;   // 9441..9472: several agents on one host

// "auto", "off" or a port number 0..65535; one error line otherwise.
Result<Listen> ParseListen(std::string_view text);

// A rank's progress as its agent saw it on the progress board (health/progress_board.h).
struct RankProgress {
  int rank = 0;                // global rank
  int64_t step = -1;           // the program's step at its last report (-1: unknown)
  double interval_s = 0;       // the recent time between two reports (0: fewer than two yet)
  double age_s = 0;            // seconds since the last report (or since the round started)
};

// 33 data members, on purpose (issue #31): a registry whose state is one handle per exported
// metric family or series (the table of docs/operations.md "4b. Metrics"), each written
// by the one method that updates it; grouping them would only hide that list. Beside them: the
// port, the registry, the exposer, the per-rank and per-category series, the newest commit time.
class AgentMetrics : public etcd::CallObserver {
 public:
  // Starts the HTTP endpoint on all interfaces. Error (one line) when the port is taken (a
  // fixed port, or the whole auto range); kOff is not an error: nullptr.
  static Result<std::unique_ptr<AgentMetrics>> Start(const Listen& listen,
                                                     const std::string& job_id,
                                                     const std::string& node_id);
  ~AgentMetrics();
  AgentMetrics(const AgentMetrics&) = delete;
  AgentMetrics& operator=(const AgentMetrics&) = delete;

  int port() const { return port_; }

  // The round this node takes part in (standby: world and nodes of the round, no workers here).
  void SetRound(int64_t round, int world_size, int nnodes, int local_workers, bool standby);
  // A round closed (each node sees each change once).
  void CountRoundChange(bool graceful);
  // A failure of this node's workers: its own, or collateral (another node's fault).
  void CountWorkerFailure(bool own);
  // Own failures the agent counted (its restarts; efdl status RESTARTS).
  void CountRestarts(int n);
  // A hang seen here: caused by a rank of this node (`own`) or waiting for another node's.
  void CountHang(bool own);
  void CountFenced();
  // The pause of a round change by phase: "detection" (a hang's silence before it was
  // declared), "rendezvous" (the old round's close seen here to the new round's start), "resume"
  // (the new round's start to every local rank's first progress report; "startup" for the
  // agent's first workers).
  void ObservePause(std::string_view phase, double seconds);
  // This node's ranks (replaces the previous set: ranks of an earlier round are dropped).
  void SetRankProgress(const std::vector<RankProgress>& ranks);
  // Stragglers (issue #32 part 3): this node's ranks' compute time per step in the last
  // summary (global rank -> seconds; replaces the previous set), and whether the round's judge
  // names this node a straggler now.
  void SetRankCompute(const std::map<int, double>& compute_s);
  void SetStraggler(bool straggler);
  // One snapshot written to storage (or a failed attempt) and its commit time (wall seconds).
  void ObservePersist(double seconds, uint64_t bytes, double committed_at);
  void CountPersistFailure();
  // Called on the agent's loop: the age of the newest persisted snapshot.
  void UpdateSnapshotAge(double now_wall);
  // The job's goodput and its wall time by category (rdzv::LedgerTotals), as the node with
  // node rank 0 reads them from the ledger; `export_it` false: this node does not export them
  // (any more).
  void SetGoodput(bool export_it, double ratio, const std::map<std::string, double>& seconds);
  // The node's etcd requests (etcd::ClientOptions::observer): any thread.
  void OnCall(std::string_view operation, double seconds, bool ok) override;
  void OnLeaseRenewalFailed(std::string_view outcome) override;

 private:
  AgentMetrics() = default;
  void Build(const std::string& job_id, const std::string& node_id);

  int port_ = 0;
  // The registry is shared with the exposer (it keeps a weak pointer); families live in it.
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* round_ = nullptr;
  prometheus::Gauge* world_size_ = nullptr;
  prometheus::Gauge* nodes_ = nullptr;
  prometheus::Gauge* local_workers_ = nullptr;
  prometheus::Gauge* standby_ = nullptr;
  prometheus::Family<prometheus::Counter>* round_changes_ = nullptr;
  prometheus::Family<prometheus::Counter>* worker_failures_ = nullptr;
  prometheus::Counter* restarts_ = nullptr;
  prometheus::Family<prometheus::Counter>* hangs_ = nullptr;
  prometheus::Counter* fenced_ = nullptr;
  prometheus::Family<prometheus::Histogram>* pause_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rank_step_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rank_step_seconds_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rank_progress_age_ = nullptr;
  struct RankGauges {
    prometheus::Gauge* step = nullptr;
    prometheus::Gauge* interval = nullptr;
    prometheus::Gauge* age = nullptr;
  };
  std::map<int, RankGauges> ranks_;
  prometheus::Family<prometheus::Gauge>* rank_compute_ = nullptr;
  std::map<int, prometheus::Gauge*> rank_compute_by_rank_;
  prometheus::Gauge* straggler_ = nullptr;
  prometheus::Histogram* persist_seconds_ = nullptr;
  prometheus::Counter* persisted_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* persists_ = nullptr;
  prometheus::Gauge* snapshot_age_ = nullptr;
  prometheus::Family<prometheus::Histogram>* etcd_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* etcd_errors_ = nullptr;
  prometheus::Family<prometheus::Counter>* lease_failures_ = nullptr;
  prometheus::Family<prometheus::Gauge>* goodput_ = nullptr;
  prometheus::Family<prometheus::Gauge>* job_seconds_ = nullptr;
  prometheus::Gauge* goodput_gauge_ = nullptr;            // while exported
  std::map<std::string, prometheus::Gauge*> job_seconds_by_category_;
  // Wall seconds of the newest snapshot persisted (0: none yet); written by persister threads.
  std::atomic<double> newest_committed_at_{0};
  // Declared last: destroyed first, so its threads stop before the metrics they read go.
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace efdl::metrics
