#include "rendezvous/sim.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/thread_annotations.h"
#include "rendezvous/driver_pool.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/protocol.h"
#include "rendezvous/rendezvous.h"

namespace efdl::rdzv {

void TrafficCounters::Reset() {
  requests = 0;
  bytes_sent = 0;
  bytes_received = 0;
  watch_events = 0;
  watches_started = 0;
  leases_lost = 0;
}

namespace {
int64_t KvBytes(const etcd::KeyValue& kv) {
  return static_cast<int64_t>(kv.key.size() + kv.value.size());
}
int64_t OpBytes(const std::vector<etcd::TxnOp>& ops) {
  int64_t n = 0;
  for (const auto& op : ops) n += static_cast<int64_t>(op.key.size() + op.value.size());
  return n;
}
}  // namespace

SimNodeClient::SimNodeClient(etcd::Client& inner, TrafficCounters& counters)
    : inner_(inner), counters_(counters), cut_(std::make_shared<std::atomic<bool>>(false)) {}

Status SimNodeClient::CheckCut() const {
  if (*cut_) return Status::Unavailable("simulated node is cut off from etcd");
  return Status::OK();
}

Result<etcd::RangeResult> SimNodeClient::Range(const std::string& key,
                                               const etcd::RangeOptions& o) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  counters_.bytes_sent += static_cast<int64_t>(key.size());
  auto r = inner_.Range(key, o);
  if (r.ok()) {
    for (const auto& kv : r->kvs) counters_.bytes_received += KvBytes(kv);
  }
  return r;
}

Result<std::optional<etcd::KeyValue>> SimNodeClient::Get(const std::string& key) {
  EFDL_ASSIGN_OR_RETURN(etcd::RangeResult r, Range(key, {}));
  if (r.kvs.empty()) return std::optional<etcd::KeyValue>();
  return std::optional<etcd::KeyValue>(std::move(r.kvs.front()));
}

Result<etcd::PutResult> SimNodeClient::Put(const std::string& key, const std::string& value,
                                           int64_t lease) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  counters_.bytes_sent += static_cast<int64_t>(key.size() + value.size());
  return inner_.Put(key, value, lease);
}

Result<etcd::DeleteResult> SimNodeClient::Delete(const std::string& key, bool prefix) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  counters_.bytes_sent += static_cast<int64_t>(key.size());
  return inner_.Delete(key, prefix);
}

Result<etcd::TxnResult> SimNodeClient::Txn(const std::vector<etcd::Compare>& compares,
                                           const std::vector<etcd::TxnOp>& then,
                                           const std::vector<etcd::TxnOp>& otherwise) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  int64_t sent = OpBytes(then) + OpBytes(otherwise);
  for (const auto& c : compares) sent += static_cast<int64_t>(c.key.size() + c.value.size());
  counters_.bytes_sent += sent;
  auto r = inner_.Txn(compares, then, otherwise);
  if (r.ok()) {
    for (const auto& g : r->gets) {
      for (const auto& kv : g.kvs) counters_.bytes_received += KvBytes(kv);
    }
  }
  return r;
}

Result<etcd::LeaseGrantResult> SimNodeClient::LeaseGrant(int64_t ttl_seconds) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  return inner_.LeaseGrant(ttl_seconds);
}

Status SimNodeClient::LeaseRevoke(int64_t lease_id) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  return inner_.LeaseRevoke(lease_id);
}

Result<int64_t> SimNodeClient::LeaseTimeToLive(int64_t lease_id) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;
  return inner_.LeaseTimeToLive(lease_id);
}

Result<std::unique_ptr<etcd::LeaseKeeper>> SimNodeClient::KeepAlive(
    int64_t lease_id, std::function<void()> on_lost) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.requests;   // its time-to-live read
  return inner_.KeepAlive(lease_id, CountingLoss(std::move(on_lost)));
}

std::function<void()> SimNodeClient::CountingLoss(std::function<void()> on_lost) {
  return [cut = cut_, counters = &counters_, f = std::move(on_lost)] {
    if (!*cut) ++counters->leases_lost;
    if (f) f();
  };
}

Result<std::unique_ptr<etcd::LeaseKeeper>> SimNodeClient::KeepGranted(
    const etcd::LeaseGrantResult& granted, std::chrono::steady_clock::time_point asked,
    std::function<void()> on_lost) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  return inner_.KeepGranted(granted, asked, CountingLoss(std::move(on_lost)));
}

Result<std::unique_ptr<etcd::Watch>> SimNodeClient::StartWatch(const std::string& key,
                                                               const etcd::WatchOptions& options,
                                                               etcd::WatchCallback callback) {
  EFDL_RETURN_IF_ERROR(CheckCut());
  ++counters_.watches_started;
  return inner_.StartWatch(
      key, options,
      [cut = cut_, counters = &counters_, cb = std::move(callback)](const etcd::WatchUpdate& u) {
        if (*cut) return;
        counters->watch_events += static_cast<int64_t>(u.events.size());
        for (const auto& e : u.events) counters->bytes_received += KvBytes(e.kv);
        cb(u);
      });
}

namespace {

using Clock = std::chrono::steady_clock;

double CpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto tv = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return tv(ru.ru_utime) + tv(ru.ru_stime);
}

// Resident memory of another process in MiB (VmRSS of /proc/<pid>/status); -1: unknown.
double ProcessRssMb(int pid) {
  if (pid <= 0) return -1;
  std::FILE* f = std::fopen(fmt::format("/proc/{}/status", pid).c_str(), "r");
  if (f == nullptr) return -1;
  char line[256];
  double mb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long kb = 0;
    if (std::sscanf(line, "VmRSS: %llu kB", &kb) == 1) {
      mb = static_cast<double>(kb) / 1024.0;
      break;
    }
  }
  std::fclose(f);
  return mb;
}

// CPU seconds another process used so far (utime + stime of /proc/<pid>/stat); -1: unknown.
double ProcessCpuSeconds(int pid) {
  if (pid <= 0) return -1;
  std::FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // Fields after the command name (which may hold spaces) start behind the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return -1;
  unsigned long long utime = 0, stime = 0;
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
                  &stime) != 2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// The harness: owns the simulated nodes and follows their events on one thread.
class Harness {
 public:
  Harness(etcd::Client& client, const SimOptions& options)
      : client_(client), opt_(options), rng_(options.seed) {
    if (opt_.driver_threads > 0) pool_ = std::make_unique<DriverPool>(opt_.driver_threads);
  }
  ~Harness() { Shutdown(); }

  // Creates a node and joins it to the job.
  Status AddNode() {
    EFDL_RETURN_IF_ERROR(CreateNodes(1));
    return JoinNode(nodes_.size() - 1);
  }

  // Joins nodes [first, nodes_.size()) from `threads` threads at once, as agents started
  // together on many machines would.
  Status JoinAll(size_t first, int threads) {
    std::atomic<size_t> next{first};
    std::mutex mu;
    Status failed;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        for (size_t i = next++; i < nodes_.size(); i = next++) {
          Status s = JoinNode(i);
          if (!s.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            failed = s;
          }
        }
      });
    }
    for (auto& t : pool) t.join();
    return failed;
  }

  Status CreateNodes(int count) {
    for (int k = 0; k < count; ++k) EFDL_RETURN_IF_ERROR(CreateNode());
    return Status::OK();
  }

  Status JoinNode(size_t index) {
    Status s = nodes_[index]->rdzv->Join();
    return s.WithContext(fmt::format("simulated node {} could not join", nodes_[index]->id));
  }

  Status CreateNode() {
    int index = static_cast<int>(nodes_.size());
    auto node = std::make_unique<SimNode>();
    node->id = fmt::format("n{:05}", index);
    etcd::Client& via = opt_.node_clients.empty()
                            ? client_
                            : *opt_.node_clients[static_cast<size_t>(index) %
                                                 opt_.node_clients.size()];
    node->client = std::make_unique<SimNodeClient>(via, counters_);
    RendezvousOptions o;
    o.job_id = opt_.job_id;
    o.node_id = node->id;
    o.advertise_addr = "127.0.0.1";
    // As an agent's (src/cli/run_config.cc: the script's name), so each join checks the job's
    // program as a real agent's does (registration.cc RegisterNode) instead of skipping it.
    o.program = "train.py";
    o.min_nodes = std::max(1, opt_.nodes / 2);
    o.max_nodes = opt_.nodes;
    o.ttl = opt_.ttl;
    // Formation is measured at MAX (all N registered); the last call only matters if joins
    // straggle, and then it would measure the last call rather than the protocol.
    o.last_call = std::chrono::seconds(30);
    o.join_timeout = std::chrono::seconds(600);
    o.liveness_window = opt_.liveness_window;
    o.on_event = [this, index] {
      {
        MutexLock lock(mu_);
        ready_.push_back(index);
      }
      cv_.notify_one();
    };
    node->rdzv = NewEtcdRendezvous(*node->client, std::move(o), pool_.get());
    nodes_.push_back(std::move(node));
    return Status::OK();
  }

  // Waits until every live node started the same round with `expect` members (plus standbys).
  Status WaitFormed(int expect) {
    auto deadline = Clock::now() + opt_.scenario_timeout;
    while (true) {
      Drain();
      if (Formed(expect)) return Status::OK();
      MutexLock lock(mu_);
      if (Clock::now() >= deadline) break;
      cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)),
                     [&]() EFDL_REQUIRES(mu_) { return !ready_.empty(); });
    }
    int started = 0;
    for (const auto& n : nodes_) started += n->alive && n->nnodes == expect ? 1 : 0;
    return Status::DeadlineExceeded(fmt::format(
        "only {} of {} live nodes started a round of {} nodes within {} s", started, Alive(),
        expect, std::chrono::duration_cast<std::chrono::seconds>(opt_.scenario_timeout).count()));
  }

  int Alive() const {
    int n = 0;
    for (const auto& node : nodes_) n += node->alive ? 1 : 0;
    return n;
  }

  // Kills `count` random live nodes at once: cut off, then leases revoked (by "etcd").
  Status Kill(int count, bool revoke, bool coordinator_first) {
    std::vector<int> live;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i]->alive) live.push_back(static_cast<int>(i));
    }
    std::shuffle(live.begin(), live.end(), rng_);
    if (coordinator_first) {
      auto rd = client_.Get(JobKeys(opt_.job_id).round);
      if (rd.ok() && rd->has_value()) {
        auto rec = RoundRecord::Decode((*rd)->value);
        for (size_t i = 0; rec.ok() && i < live.size(); ++i) {
          if (nodes_[static_cast<size_t>(live[i])]->id == rec->coordinator) {
            std::swap(live[0], live[i]);
          }
        }
      }
    }
    std::vector<int64_t> leases;
    for (int k = 0; k < count && k < static_cast<int>(live.size()); ++k) {
      SimNode& n = *nodes_[static_cast<size_t>(live[static_cast<size_t>(k)])];
      auto kv = client_.Get(JobKeys(opt_.job_id).Node(n.id));
      n.client->Cut();
      n.alive = false;
      n.nnodes = 0;
      if (kv.ok() && kv->has_value()) leases.push_back((*kv)->lease);
      last_killed_ = n.id;
    }
    if (revoke) {
      for (int64_t lease : leases) {
        ++counters_.requests;
        Status s = client_.LeaseRevoke(lease);
        if (!s.ok() && !s.IsNotFound()) return s;
      }
    } else {
      pending_revokes_.insert(pending_revokes_.end(), leases.begin(), leases.end());
    }
    return Status::OK();
  }

  void RevokePending() {
    for (int64_t lease : pending_revokes_) (void)client_.LeaseRevoke(lease);
    pending_revokes_.clear();
  }

  // A live member's worker failed because its peer died: it reports, as the agent would.
  void ReportFailureFromSomeMember() {
    for (auto& n : nodes_) {
      if (n->alive && n->round != 0 && !n->standby) {
        n->rdzv->ReportWorkerFailure(n->round, "simulated: peer connection reset");
        return;
      }
    }
  }

  TrafficCounters& counters() { return counters_; }

  void Shutdown() {
    if (nodes_.empty()) return;
    std::vector<int64_t> leases;
    auto range = client_.Range(JobKeys(opt_.job_id).nodes, {.prefix = true});
    if (range.ok()) {
      for (const auto& kv : range->kvs) leases.push_back(kv.lease);
    }
    for (auto& n : nodes_) n->client->Cut();   // inert: no re-rounds while we tear down
    nodes_.clear();
    for (int64_t lease : leases) (void)client_.LeaseRevoke(lease);
    (void)client_.Delete(JobKeys(opt_.job_id).prefix, true);
  }

 private:
  struct SimNode {
    std::string id;
    std::unique_ptr<SimNodeClient> client;
    std::unique_ptr<Rendezvous> rdzv;
    bool alive = true;
    int64_t round = 0;        // the round its (simulated) workers run; 0: none
    int nnodes = 0;
    bool standby = false;
  };

  void Drain() {
    std::deque<int> ready;
    {
      MutexLock lock(mu_);
      ready.swap(ready_);
    }
    for (int index : ready) {
      SimNode& n = *nodes_[static_cast<size_t>(index)];
      while (auto e = n.rdzv->WaitEvent(std::chrono::milliseconds(0))) {
        switch (e->type) {
          case Event::Type::kRoundStarted:
            n.round = e->round;
            n.nnodes = e->assignment.nnodes;
            n.standby = e->assignment.standby;
            break;
          case Event::Type::kRoundClosing:
          case Event::Type::kFenced:
            n.round = 0;
            n.nnodes = 0;
            break;
          case Event::Type::kFailed:
            EFDL_LOG_WARN("sim: node {} failed: {}", n.id, e->message);
            break;
          case Event::Type::kJobComplete:
          case Event::Type::kSuspended:
          case Event::Type::kPeerGaveUp:
            break;
        }
      }
    }
  }

  bool Formed(int expect) const {
    int64_t round = -1;
    for (const auto& n : nodes_) {
      if (!n->alive) continue;
      if (n->round == 0 || n->nnodes != expect) return false;
      if (round == -1) round = n->round;
      if (n->round != round) return false;
    }
    return round > 0;
  }

  etcd::Client& client_;
  SimOptions opt_;
  std::mt19937 rng_;
  TrafficCounters counters_;
  std::unique_ptr<DriverPool> pool_;              // before nodes_: they leave before it stops
  std::vector<std::unique_ptr<SimNode>> nodes_;
  std::vector<int64_t> pending_revokes_;
  std::string last_killed_;
  Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<int> ready_ EFDL_GUARDED_BY(mu_);   // nodes with queued events
};

}  // namespace

Result<SimReport> RunScaleSim(etcd::Client& client, const SimOptions& options) {
  if (options.nodes < 2) return Status::InvalidArgument("--nodes must be at least 2");
  EFDL_RETURN_IF_ERROR(ValidateId("job id", options.job_id));
  (void)client.Delete(JobKeys(options.job_id).prefix, true);  // a clean job
  Harness h(client, options);
  SimReport report;
  report.nodes = options.nodes;
  report.driver_threads = options.driver_threads;

  // Runs one scenario: `trigger`, then wait for a round of `expect` nodes; counts the traffic
  // until that moment plus a short settle for the coordinator's trailing status write.
  auto run = [&](const std::string& name, auto&& trigger, auto&& expect) -> bool {
    SimScenario s;
    s.name = name;
    h.counters().Reset();
    double cpu0 = CpuSeconds();
    double etcd_cpu0 = ProcessCpuSeconds(options.etcd_pid);
    auto t0 = Clock::now();
    Status st = trigger();
    if (st.ok()) st = h.WaitFormed(expect());
    s.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    s.agent_cpu_ms_per_node = (CpuSeconds() - cpu0) * 1000.0 / options.nodes;
    double etcd_cpu1 = ProcessCpuSeconds(options.etcd_pid);
    s.etcd_cpu_ms = etcd_cpu0 < 0 || etcd_cpu1 < 0 ? -1 : (etcd_cpu1 - etcd_cpu0) * 1000.0;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    s.ok = st.ok();
    s.error = st.ok() ? "" : st.message();
    s.nodes_after = h.Alive();
    s.requests = h.counters().requests;
    s.bytes = h.counters().bytes_sent + h.counters().bytes_received;
    s.watch_events = h.counters().watch_events;
    s.watches_started = h.counters().watches_started;
    s.leases_lost = h.counters().leases_lost;
    EFDL_LOG_INFO("sim N={}: {} {} in {:.3f} s ({} requests, {} bytes, {} watch events, {} "
                  "watches started, {} leases of live nodes lost)", options.nodes, name,
                  s.ok ? "done" : "FAILED", s.seconds, s.requests, s.bytes, s.watch_events,
                  s.watches_started, s.leases_lost);
    report.scenarios.push_back(s);
    return s.ok;
  };

  int n = options.nodes;
  std::mutex mu;
  std::condition_variable cv;
  int64_t seen = 0;
  std::unique_ptr<etcd::Watch> baseline_watch;
  {
    // Baseline in the same run, on the same etcd and machine: N clients each put one key (from
    // join_threads threads) while one prefix watch waits for all N events. A re-round is about
    // two such exchanges plus two fan-outs, so the ratio says what the protocol adds over raw
    // etcd traffic, independent of how loaded the machine is.
    std::string scratch = JobKeys(options.job_id).prefix + "baseline/";
    auto rev = client.CurrentRevision();
    if (!rev.ok()) return rev.status();
    auto watch = client.StartWatch(scratch, {true, *rev + 1, false}, [&](const etcd::WatchUpdate& u) {
      std::lock_guard<std::mutex> lock(mu);
      seen += static_cast<int64_t>(u.events.size());
      cv.notify_all();
    });
    if (!watch.ok()) return watch.status();
    auto t0 = Clock::now();
    std::atomic<int> next{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < options.join_threads; ++t) {
      pool.emplace_back([&] {
        for (int i = next++; i < n; i = next++) {
          (void)client.Put(fmt::format("{}{:05}", scratch, i), R"({"r":1,"st":"ack","port":1})");
        }
      });
    }
    for (auto& t : pool) t.join();
    std::unique_lock<std::mutex> lock(mu);
    bool all = cv.wait_for(lock, options.scenario_timeout, [&] { return seen >= n; });
    lock.unlock();
    report.baseline_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    baseline_watch = std::move(*watch);   // cancelled at the end of the run, not in between
    (void)client.Delete(scratch, true);
    if (!all) return Status::DeadlineExceeded("the etcd baseline did not complete");
  }
  EFDL_RETURN_IF_ERROR(h.CreateNodes(n));
  bool ok = run("form", [&] { return h.JoinAll(0, options.join_threads); }, [&] { return n; });
  ok = ok && run("kill_one", [&] { return h.Kill(1, true, false); }, [&] { return h.Alive(); });
  ok = ok && run("crash_coordinator_reported", [&] {
    EFDL_RETURN_IF_ERROR(h.Kill(1, false, true));
    h.ReportFailureFromSomeMember();
    return Status::OK();
  }, [&] { return h.Alive(); });
  if (ok) {
    h.RevokePending();   // the crashed node's lease ends later; it was already left out
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  ok = ok && run("kill_10_percent", [&] { return h.Kill(std::max(1, n / 10), true, false); },
                 [&] { return h.Alive(); });
  ok = ok && run("join_one", [&] { return h.AddNode(); }, [&] { return h.Alive(); });
  if (ok) {
    // Idle job: what N agents cost while training is steady.
    h.counters().Reset();
    double cpu0 = CpuSeconds();
    auto idle = std::chrono::seconds(5);
    std::this_thread::sleep_for(idle);
    double cpu = CpuSeconds() - cpu0;
    report.steady_cpu_percent_per_node = cpu / 5.0 * 100.0 / h.Alive();
    report.steady_requests_per_node_per_min = h.counters().requests * 12 / std::max(1, h.Alive());
  }
  report.etcd_rss_mb = ProcessRssMb(options.etcd_pid);
  return report;
}

std::string SimReport::ToJson() const {
  nlohmann::json j;
  j["nodes"] = nodes;
  j["driver_threads"] = driver_threads;
  j["baseline_seconds"] = baseline_seconds;
  j["steady_cpu_percent_per_node"] = steady_cpu_percent_per_node;
  j["steady_requests_per_node_per_min"] = steady_requests_per_node_per_min;
  j["etcd_rss_mb"] = etcd_rss_mb;
  j["etcd_gogc"] = etcd_gogc ? nlohmann::json(*etcd_gogc) : nlohmann::json(nullptr);
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& s : scenarios) {
    arr.push_back({{"name", s.name},
                   {"ok", s.ok},
                   {"seconds", s.seconds},
                   {"nodes_after", s.nodes_after},
                   {"requests", s.requests},
                   {"bytes", s.bytes},
                   {"watch_events", s.watch_events},
                   {"watches_started", s.watches_started},
                   {"leases_lost", s.leases_lost},
                   {"agent_cpu_ms_per_node", s.agent_cpu_ms_per_node},
                   {"etcd_cpu_ms", s.etcd_cpu_ms},
                   {"error", s.error}});
  }
  j["scenarios"] = arr;
  return j.dump();
}

}  // namespace efdl::rdzv
