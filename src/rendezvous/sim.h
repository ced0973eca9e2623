// Scale simulation: many nodes' real Rendezvous objects in one process, sharing one or a few
// etcd::Clients (each one watch stream, one keep-alive stream), so the etcd traffic is exactly
// what N agents would send. The nodes' driver steps run on a small DriverPool (driver_pool.h: many
// nodes per thread, issue #37) or, as the first simulator did, on one thread per node. Only the
// workers are simulated: a node "runs" a round by recording its kRoundStarted event. Used by
// `efdl sim` and bench/scale.py; see docs/scale.md.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace efdl::rdzv {

// Traffic one or more nodes caused, as the etcd server sees it. Thread-safe (atomics).
struct TrafficCounters {
  std::atomic<int64_t> requests{0};      // unary RPCs: range, put, delete, txn, lease grant/revoke
  std::atomic<int64_t> bytes_sent{0};    // keys + values in requests
  std::atomic<int64_t> bytes_received{0};  // keys + values in answers and watch events
  std::atomic<int64_t> watch_events{0};
  std::atomic<int64_t> watches_started{0};
  // Leases of nodes that were not cut off that etcd or the keep-alive declared lost: a live node
  // fenced out by its own starvation (a killed or crashed node's lease is not counted).
  std::atomic<int64_t> leases_lost{0};
  void Reset();
};

// A per-node view of a shared client: counts traffic into shared counters, and can be cut off
// (every call fails, no watch delivers) to model a node that died or was partitioned while its
// lease lives on. Thread-safe. `inner` and `counters` must outlive it.
class SimNodeClient final : public etcd::Client {
 public:
  SimNodeClient(etcd::Client& inner, TrafficCounters& counters);
  void Cut() { *cut_ = true; }
  bool cut() const { return *cut_; }

  Result<etcd::RangeResult> Range(const std::string& key, const etcd::RangeOptions& o) override;
  Result<std::optional<etcd::KeyValue>> Get(const std::string& key) override;
  Result<etcd::PutResult> Put(const std::string& key, const std::string& value,
                              int64_t lease) override;
  Result<etcd::DeleteResult> Delete(const std::string& key, bool prefix) override;
  Result<etcd::TxnResult> Txn(const std::vector<etcd::Compare>& compares,
                              const std::vector<etcd::TxnOp>& then,
                              const std::vector<etcd::TxnOp>& otherwise) override;
  Result<etcd::LeaseGrantResult> LeaseGrant(int64_t ttl_seconds) override;
  Status LeaseRevoke(int64_t lease_id) override;
  Result<int64_t> LeaseTimeToLive(int64_t lease_id) override;
  // KeepAlive reads the lease's time-to-live first (one request); KeepGranted does not.
  Result<std::unique_ptr<etcd::LeaseKeeper>> KeepAlive(int64_t lease_id,
                                                       std::function<void()> on_lost) override;
  Result<std::unique_ptr<etcd::LeaseKeeper>> KeepGranted(
      const etcd::LeaseGrantResult& granted, std::chrono::steady_clock::time_point asked,
      std::function<void()> on_lost) override;
  Result<std::unique_ptr<etcd::Watch>> StartWatch(const std::string& key,
                                                  const etcd::WatchOptions& options,
                                                  etcd::WatchCallback callback) override;

 private:
  Status CheckCut() const;
  // `on_lost`, counting the loss first unless this node was cut off.
  std::function<void()> CountingLoss(std::function<void()> on_lost);
  etcd::Client& inner_;
  TrafficCounters& counters_;
  std::shared_ptr<std::atomic<bool>> cut_;
};

struct SimOptions {
  std::string job_id = "sim";
  int nodes = 100;
  std::chrono::milliseconds ttl{std::chrono::seconds(10)};
  std::chrono::milliseconds liveness_window{400};
  std::chrono::milliseconds scenario_timeout{std::chrono::seconds(120)};
  uint32_t seed = 1;
  int join_threads = 64;   // nodes joining at the same time during formation
  // Threads that drive all the nodes (DriverPool); 0: one driver thread per node, as a real
  // agent runs it (the first simulator: 5,000 threads on 2 cores never formed).
  int driver_threads = 32;
  int etcd_pid = 0;        // the etcd process, to report its CPU per scenario (0: unknown)
  // Connections the simulated nodes use, node i the (i mod size)-th (each its own gRPC channel,
  // watch stream and keep-alive stream; must outlive the run); empty: all use `client`. etcd
  // serves one keep-alive stream's renewals one after another, so 10,000 leases on one stream
  // are renewed too slowly and expire (issue #37); real agents each have their own.
  std::vector<etcd::Client*> node_clients;
};

// One measured scenario: from the trigger to the moment every expected node had started the
// new round (kRoundStarted with the expected number of nodes).
struct SimScenario {
  std::string name;
  bool ok = false;
  double seconds = 0;
  int nodes_after = 0;
  int64_t requests = 0;
  int64_t bytes = 0;                      // sent + received
  int64_t watch_events = 0;
  int64_t watches_started = 0;
  int64_t leases_lost = 0;                // TrafficCounters::leases_lost
  double agent_cpu_ms_per_node = 0;       // this process's CPU during the scenario / nodes
  double etcd_cpu_ms = 0;                 // etcd's CPU during the scenario (-1: unknown)
  std::string error;
};

struct SimReport {
  int nodes = 0;
  int driver_threads = 0;                 // SimOptions::driver_threads (0: a thread per node)
  double baseline_seconds = 0;            // N concurrent puts seen by one watch (raw etcd)
  std::vector<SimScenario> scenarios;
  double steady_cpu_percent_per_node = 0; // idle job: CPU of one node as % of a core
  int64_t steady_requests_per_node_per_min = 0;
  double etcd_rss_mb = -1;                // etcd's resident memory at the end (-1: unknown)
  // The GOGC the private etcd ran with (EmbeddedEtcd::go_gc: "400" unless the caller's
  // environment set one); nullopt: an etcd of the caller's (--etcd).
  std::optional<std::string> etcd_gogc;
  std::string ToJson() const;
};

// Runs, against `client` (a real etcd for figures that mean something): formation of N nodes,
// one node killed (lease revoked), one node crashed and reported by a peer's worker failure
// (lease alive), 10% killed at once, one new node taken in, and a few idle seconds. Scenarios
// run in this order on the same job; a failed one stops the run (its error is in the report).
Result<SimReport> RunScaleSim(etcd::Client& client, const SimOptions& options);

}  // namespace efdl::rdzv
