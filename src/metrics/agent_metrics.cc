#include "metrics/agent_metrics.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <exception>
#include <chrono>
#include <set>
#include <thread>
#include <utility>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace efdl::metrics {

Result<Listen> ParseListen(std::string_view text) {
  Listen out;
  if (text.empty() || text == "auto") return out;
  if (text == "off") {
    out.mode = Listen::Mode::kOff;
    return out;
  }
  int port = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
  if (ec != std::errc() || end != text.data() + text.size() || port < 0 || port > 65535) {
    return Status::InvalidArgument(fmt::format(
        "--metrics-port {} is not a port: give a port number (0: any free one), 'auto' (the "
        "default: {} or the next free port up to {}) or 'off'",
        text, kDefaultPort, kDefaultPort + kAutoRange - 1));
  }
  out.mode = Listen::Mode::kPort;
  out.port = port;
  return out;
}

namespace {

// The exposer on 0.0.0.0:port; nullptr (and why) when the port cannot be bound.
std::unique_ptr<prometheus::Exposer> TryExpose(int port, std::string* why) {
  try {
    // One request thread: a scrape every few seconds needs no more.
    return std::make_unique<prometheus::Exposer>(fmt::format("0.0.0.0:{}", port), 1);
  } catch (const std::exception& e) {
    *why = e.what();
    return nullptr;
  }
}

prometheus::Histogram::BucketBoundaries PauseBuckets() {
  return {0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600};
}

}  // namespace

Result<std::unique_ptr<AgentMetrics>> AgentMetrics::Start(const Listen& listen,
                                                          const std::string& job_id,
                                                          const std::string& node_id) {
  if (listen.mode == Listen::Mode::kOff) return std::unique_ptr<AgentMetrics>();
  std::unique_ptr<AgentMetrics> m(new AgentMetrics());
  m->Build(job_id, node_id);
  std::string why;
  if (listen.mode == Listen::Mode::kPort) {
    m->exposer_ = TryExpose(listen.port, &why);
    if (!m->exposer_) {
      return Status::Unavailable(fmt::format(
          "cannot serve metrics on port {} ({}): give another --metrics-port, 0 for any free "
          "port, or 'off'",
          listen.port, why));
    }
  } else {
    for (int p = kDefaultPort; p < kDefaultPort + kAutoRange && !m->exposer_; ++p) {
      m->exposer_ = TryExpose(p, &why);
    }
    if (!m->exposer_) {
      return Status::Unavailable(fmt::format(
          "no free metrics port in {}..{} (last: {}): give --metrics-port PORT, 0 for any free "
          "port, or 'off'",
          kDefaultPort, kDefaultPort + kAutoRange - 1, why));
    }
  }
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? listen.port : ports.front();
  m->exposer_->RegisterCollectable(m->registry_);
  return m;
}

AgentMetrics::~AgentMetrics() {
  if (!exposer_) return;
  // civetweb's listener notices its stop flag only when its poll returns, which without a
  // connection takes up to 2 s: knock while the exposer stops, so that stopping takes ms.
  std::atomic<bool> stopped{false};
  std::thread knock([this, &stopped] {
    while (!stopped.load()) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(port_));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  knock.join();
}

void AgentMetrics::Build(const std::string& job_id, const std::string& node_id) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *registry_;
  const prometheus::Labels ids = {{"efdl_job", job_id}, {"efdl_node", node_id}};
  auto gauge = [&](const char* name, const char* help) -> prometheus::Gauge& {
    return BuildGauge().Name(name).Help(help).Labels(ids).Register(r).Add({});
  };
  round_ = &gauge("efdl_round", "The newest round this node took part in (standby included)");
  world_size_ = &gauge("efdl_world_size", "Processes in the current round (all nodes)");
  nodes_ = &gauge("efdl_nodes", "Nodes in the current round");
  local_workers_ = &gauge("efdl_local_workers", "This node's workers in the current round");
  standby_ = &gauge("efdl_standby", "1 while this node is a standby (the job is at its maximum)");
  round_changes_ = &BuildCounter()
                        .Name("efdl_round_changes_total")
                        .Help("Rounds that closed while this node followed the job, by whether "
                              "the change was orderly (join, leave, suspend) or not (a failure)")
                        .Labels(ids)
                        .Register(r);
  worker_failures_ = &BuildCounter()
                          .Name("efdl_worker_failures_total")
                          .Help("Failures of this node's workers: blame=own (its program or "
                                "node) or collateral (a peer failed, left or hung)")
                          .Labels(ids)
                          .Register(r);
  restarts_ = &BuildCounter()
                   .Name("efdl_restarts_total")
                   .Help("Own worker failures this node counted (efdl status RESTARTS)")
                   .Labels(ids)
                   .Register(r)
                   .Add({});
  hangs_ = &BuildCounter()
                .Name("efdl_hangs_total")
                .Help("Hangs this node detected: blame=own (a rank here caused it and was "
                      "ended) or elsewhere (waiting for another node's rank)")
                .Labels(ids)
                .Register(r);
  fenced_ = &BuildCounter()
                 .Name("efdl_fenced_total")
                 .Help("Times this node lost its etcd lease and was fenced out of a round")
                 .Labels(ids)
                 .Register(r)
                 .Add({});
  pause_ = &BuildHistogram()
                .Name("efdl_pause_seconds")
                .Help("Phases of the pause at a round change as this node saw it: detection (a "
                      "hang's silence), rendezvous (close to next round), resume (next round "
                      "to every local rank's first progress report); startup: the same for "
                      "this node's first workers")
                .Labels(ids)
                .Register(r);
  rank_step_ = &BuildGauge()
                    .Name("efdl_rank_step")
                    .Help("The step a rank of this node last reported (State.commit(), "
                          "efdl.progress())")
                    .Labels(ids)
                    .Register(r);
  rank_step_seconds_ = &BuildGauge()
                            .Name("efdl_rank_step_seconds")
                            .Help("Recent seconds between two progress reports of a rank")
                            .Labels(ids)
                            .Register(r);
  rank_progress_age_ = &BuildGauge()
                            .Name("efdl_rank_progress_age_seconds")
                            .Help("Seconds since a rank's last progress report")
                            .Labels(ids)
                            .Register(r);
  rank_compute_ = &BuildGauge()
                       .Name("efdl_rank_compute_seconds")
                       .Help("A rank's compute time per step (to its gradients ready, without "
                             "waiting for peers), median over the last straggler summary")
                       .Labels(ids)
                       .Register(r);
  straggler_ = &gauge("efdl_straggler",
                      "1 while the round's judge names this node a straggler (--straggler-factor)");
  persist_seconds_ = &BuildHistogram()
                          .Name("efdl_persist_seconds")
                          .Help("Time to write one snapshot from shared memory to storage")
                          .Labels(ids)
                          .Register(r)
                          .Add({}, PauseBuckets());
  persisted_bytes_ = &BuildCounter()
                          .Name("efdl_persisted_bytes_total")
                          .Help("Snapshot bytes written to storage by this node")
                          .Labels(ids)
                          .Register(r)
                          .Add({});
  persists_ = &BuildCounter()
                   .Name("efdl_persists_total")
                   .Help("Snapshot writes to storage by result (ok, error)")
                   .Labels(ids)
                   .Register(r);
  etcd_seconds_ = &BuildHistogram()
                       .Name("efdl_etcd_request_seconds")
                       .Help("This agent's etcd requests by operation, retries included")
                       .Labels(ids)
                       .Register(r);
  etcd_errors_ = &BuildCounter()
                      .Name("efdl_etcd_request_errors_total")
                      .Help("This agent's etcd requests that failed (after their retries)")
                      .Labels(ids)
                      .Register(r);
  lease_failures_ = &BuildCounter()
                        .Name("efdl_lease_renewals_failed_total")
                        .Help("Renewals of this agent's etcd lease that failed: outcome=late (no "
                              "answer by its local expiry) or lost (it expired)")
                        .Labels(ids)
                        .Register(r);
  goodput_ = &BuildGauge()
                  .Name("efdl_goodput_ratio")
                  .Help("The job's training kept / wall time, from its goodput ledger (efdl "
                        "events); exported by the node with node rank 0, every 10 s")
                  .Labels(ids)
                  .Register(r);
  job_seconds_ = &BuildGauge()
                      .Name("efdl_job_seconds")
                      .Help("The job's wall time by ledger category (training, lost, startup, "
                            "restore, rendezvous, waiting, hung, suspended); node rank 0 only")
                      .Labels(ids)
                      .Register(r);
  snapshot_age_ = &gauge("efdl_snapshot_age_seconds",
                         "Age of the newest snapshot this node persisted (since its commit)");
}

void AgentMetrics::OnCall(std::string_view operation, double seconds, bool ok) {
  static const prometheus::Histogram::BucketBoundaries kEtcdBuckets = {
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5};
  const prometheus::Labels op = {{"operation", std::string(operation)}};
  etcd_seconds_->Add(op, kEtcdBuckets).Observe(seconds);
  if (!ok) etcd_errors_->Add(op).Increment();
}

void AgentMetrics::SetGoodput(bool export_it, double ratio,
                              const std::map<std::string, double>& seconds) {
  if (!export_it) {
    if (goodput_gauge_ != nullptr) goodput_->Remove(goodput_gauge_);
    goodput_gauge_ = nullptr;
    for (auto& [_, g] : job_seconds_by_category_) job_seconds_->Remove(g);
    job_seconds_by_category_.clear();
    return;
  }
  if (goodput_gauge_ == nullptr) goodput_gauge_ = &goodput_->Add({});
  goodput_gauge_->Set(ratio);
  for (const auto& [category, s] : seconds) {
    auto it = job_seconds_by_category_.find(category);
    if (it == job_seconds_by_category_.end()) {
      it = job_seconds_by_category_
               .emplace(category, &job_seconds_->Add({{"category", category}}))
               .first;
    }
    it->second->Set(s);
  }
}

void AgentMetrics::OnLeaseRenewalFailed(std::string_view outcome) {
  lease_failures_->Add({{"outcome", std::string(outcome)}}).Increment();
}

void AgentMetrics::SetRound(int64_t round, int world_size, int nnodes, int local_workers,
                            bool standby) {
  round_->Set(static_cast<double>(round));
  world_size_->Set(world_size);
  nodes_->Set(nnodes);
  local_workers_->Set(standby ? 0 : local_workers);
  standby_->Set(standby ? 1 : 0);
}

void AgentMetrics::CountRoundChange(bool graceful) {
  round_changes_->Add({{"graceful", graceful ? "true" : "false"}}).Increment();
}

void AgentMetrics::CountWorkerFailure(bool own) {
  worker_failures_->Add({{"blame", own ? "own" : "collateral"}}).Increment();
}

void AgentMetrics::CountRestarts(int n) { restarts_->Increment(n); }

void AgentMetrics::CountHang(bool own) {
  hangs_->Add({{"blame", own ? "own" : "elsewhere"}}).Increment();
}

void AgentMetrics::CountFenced() { fenced_->Increment(); }

void AgentMetrics::ObservePause(std::string_view phase, double seconds) {
  pause_->Add({{"phase", std::string(phase)}}, PauseBuckets()).Observe(std::max(0.0, seconds));
}

void AgentMetrics::SetRankProgress(const std::vector<RankProgress>& ranks) {
  std::set<int> seen;
  for (const RankProgress& p : ranks) {
    seen.insert(p.rank);
    auto it = ranks_.find(p.rank);
    if (it == ranks_.end()) {
      const prometheus::Labels l = {{"rank", std::to_string(p.rank)}};
      it = ranks_.emplace(p.rank, RankGauges{&rank_step_->Add(l), &rank_step_seconds_->Add(l),
                                             &rank_progress_age_->Add(l)})
               .first;
    }
    it->second.step->Set(static_cast<double>(p.step));
    it->second.interval->Set(p.interval_s);
    it->second.age->Set(p.age_s);
  }
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    if (seen.count(it->first)) {
      ++it;
      continue;
    }
    rank_step_->Remove(it->second.step);
    rank_step_seconds_->Remove(it->second.interval);
    rank_progress_age_->Remove(it->second.age);
    it = ranks_.erase(it);
  }
}

void AgentMetrics::SetRankCompute(const std::map<int, double>& compute_s) {
  for (const auto& [rank, seconds] : compute_s) {
    auto it = rank_compute_by_rank_.find(rank);
    if (it == rank_compute_by_rank_.end()) {
      it = rank_compute_by_rank_
               .emplace(rank, &rank_compute_->Add({{"rank", std::to_string(rank)}}))
               .first;
    }
    it->second->Set(seconds);
  }
  for (auto it = rank_compute_by_rank_.begin(); it != rank_compute_by_rank_.end();) {
    if (compute_s.count(it->first)) {
      ++it;
      continue;
    }
    rank_compute_->Remove(it->second);
    it = rank_compute_by_rank_.erase(it);
  }
}

void AgentMetrics::SetStraggler(bool straggler) { straggler_->Set(straggler ? 1 : 0); }

void AgentMetrics::ObservePersist(double seconds, uint64_t bytes, double committed_at) {
  persist_seconds_->Observe(seconds);
  persisted_bytes_->Increment(static_cast<double>(bytes));
  persists_->Add({{"result", "ok"}}).Increment();
  double prev = newest_committed_at_.load();
  while (committed_at > prev && !newest_committed_at_.compare_exchange_weak(prev, committed_at)) {
  }
}

void AgentMetrics::CountPersistFailure() { persists_->Add({{"result", "error"}}).Increment(); }

void AgentMetrics::UpdateSnapshotAge(double now_wall) {
  const double at = newest_committed_at_.load();
  if (at > 0) snapshot_age_->Set(std::max(0.0, now_wall - at));
}

}  // namespace efdl::metrics
