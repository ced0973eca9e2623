// `efdl sim`: many nodes' real rendezvous in one process against one etcd, to measure how the
// protocol scales (docs/scale.md). Only the training workers are simulated.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/env_names.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "etcd/private_dirs.h"
#include "rendezvous/sim.h"

namespace efdl::cli {

namespace {

struct SimArgs {
  std::string nodes = "100";
  std::string etcd;
  bool json = false;
  double ttl_s = 10;
  int liveness_ms = 400;
  unsigned seed = 1;
  int driver_threads = 32;
  int join_threads = 64;
  int clients = 16;
  int compare_max = 2000;
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "efdl sim: error: %s\n", message.c_str());
  return code;
}

int RunSim(const SimArgs& args) {
  std::vector<int> sizes;
  std::stringstream list(args.nodes);
  for (std::string item; std::getline(list, item, ',');) {
    try {
      size_t used = 0;
      int n = std::stoi(item, &used);
      if (used != item.size() || n < 2 || n > 100000) throw std::invalid_argument(item);
      sizes.push_back(n);
    } catch (const std::exception&) {
      return Fail(2, fmt::format("--nodes '{}': give node counts from 2 to 100000, comma "
                                 "separated (e.g. 100,500,1000)", args.nodes));
    }
  }
  if (args.ttl_s < 1) return Fail(2, "--ttl must be at least 1 second");
  if (args.liveness_ms < 10) return Fail(2, "--liveness-window-ms must be at least 10");
  if (args.driver_threads < 0 || args.driver_threads > 4096) {
    return Fail(2, fmt::format("--driver-threads {}: give 1 to 4096 threads for all simulated "
                               "nodes, or 0 for one thread per node", args.driver_threads));
  }
  if (args.join_threads < 1 || args.join_threads > 4096) {
    return Fail(2, fmt::format("--join-threads {}: give 1 to 4096 (nodes joining at once)",
                               args.join_threads));
  }
  if (args.clients < 1 || args.clients > 1024) {
    return Fail(2, fmt::format("--clients {}: give 1 to 1024 etcd connections", args.clients));
  }
  if (args.compare_max < 0) {
    return Fail(2, "--compare-max must be 0 (no comparison) or a node count");
  }

  // Private etcd directories of commands that were killed along with their reaper (#38).
  etcd::RemoveStalePrivateEtcdDirs(etcd::TempBase());
  std::unique_ptr<EmbeddedEtcd> embedded;
  etcd::ClientOptions client_options;
  if (args.etcd.empty()) {
    auto started = EmbeddedEtcd::Start({});
    if (!started.ok()) return Fail(1, "cannot start a private etcd: " + started.status().message());
    embedded = std::move(*started);
    client_options.endpoints = {embedded->endpoint()};
  } else {
    auto endpoints = etcd::ParseEndpoints(args.etcd);
    if (!endpoints.ok()) return Fail(2, "--etcd: " + endpoints.status().message());
    client_options.endpoints = *endpoints;
  }
  client_options.call_timeout = std::chrono::seconds(30);
  auto client = etcd::Connect(client_options);
  if (!client.ok()) return Fail(1, "cannot reach etcd: " + client.status().message());

  auto print = [&](int n, const rdzv::SimReport& r, const rdzv::SimReport* pool_report) {
    if (args.json) {
      std::printf("%s\n", r.ToJson().c_str());
      return;
    }
    std::printf("N = %d, %s (one process, %d etcd connections, etcd %s)\n", n,
                r.driver_threads > 0
                    ? fmt::format("{} driver threads for all nodes", r.driver_threads).c_str()
                    : "one driver thread per node (the first simulator)",
                args.clients,
                embedded ? fmt::format("private, GOGC {}", r.etcd_gogc.value_or("?")).c_str()
                         : args.etcd.c_str());
    std::printf("  baseline: %d concurrent puts seen by one watch in %.3f s (ratio below: "
                "scenario / baseline)\n", n, r.baseline_seconds);
    std::printf("  %-28s %8s %7s %10s %12s %12s %12s %12s%s\n", "scenario", "seconds", "ratio",
                "requests", "bytes", "watch evts", "cpu ms/node", "etcd cpu ms",
                pool_report != nullptr ? "  vs pool" : "");
    for (size_t i = 0; i < r.scenarios.size(); ++i) {
      const auto& s = r.scenarios[i];
      std::string versus;
      if (pool_report != nullptr && i < pool_report->scenarios.size()) {
        const auto& p = pool_report->scenarios[i];
        versus = fmt::format("  x{:.1f} time, x{:.1f} cpu", s.seconds / std::max(1e-9, p.seconds),
                             s.agent_cpu_ms_per_node / std::max(1e-9, p.agent_cpu_ms_per_node));
      }
      std::printf("  %-28s %8.3f %7.1f %10lld %12lld %12lld %12.3f %12.0f%s%s\n", s.name.c_str(),
                  s.seconds, s.seconds / std::max(1e-9, r.baseline_seconds),
                  static_cast<long long>(s.requests), static_cast<long long>(s.bytes),
                  static_cast<long long>(s.watch_events), s.agent_cpu_ms_per_node, s.etcd_cpu_ms,
                  versus.c_str(), s.ok ? "" : ("  FAILED: " + s.error).c_str());
    }
    std::printf("  steady: %.4f %% of a core per node, %lld requests per node per minute "
                "(plus lease keep-alives on the shared stream)\n",
                r.steady_cpu_percent_per_node,
                static_cast<long long>(r.steady_requests_per_node_per_min));
    if (r.etcd_rss_mb >= 0) std::printf("  etcd resident memory at the end: %.0f MiB\n", r.etcd_rss_mb);
    std::fflush(stdout);
  };

  std::vector<std::unique_ptr<etcd::Client>> node_clients;
  std::vector<etcd::Client*> node_client_ptrs;
  for (int i = 0; i < args.clients; ++i) {
    auto c = etcd::Connect(client_options);
    if (!c.ok()) return Fail(1, "cannot reach etcd: " + c.status().message());
    node_client_ptrs.push_back(c->get());
    node_clients.push_back(std::move(*c));
  }

  int rc = 0;
  for (int n : sizes) {
    rdzv::SimOptions o;
    o.job_id = fmt::format("sim-{}", n);
    o.nodes = n;
    o.ttl = std::chrono::milliseconds(static_cast<int64_t>(args.ttl_s * 1000));
    o.liveness_window = std::chrono::milliseconds(args.liveness_ms);
    o.seed = args.seed;
    o.driver_threads = args.driver_threads;
    o.join_threads = args.join_threads;
    o.node_clients = node_client_ptrs;
    o.etcd_pid = embedded ? embedded->pid() : 0;
    auto report = rdzv::RunScaleSim(**client, o);
    if (!report.ok()) return Fail(1, report.status().message());
    if (embedded) report->etcd_gogc = embedded->go_gc();
    print(n, *report, nullptr);
    for (const auto& s : report->scenarios) rc = s.ok ? rc : 1;
    // The first simulator (a thread per node) in the same run, on the same etcd, where it still
    // reaches: its figures and the ratio to the pool's.
    if (args.driver_threads > 0 && n <= args.compare_max) {
      o.job_id = fmt::format("sim-{}-threads", n);
      o.driver_threads = 0;
      auto old = rdzv::RunScaleSim(**client, o);
      if (!old.ok()) return Fail(1, old.status().message());
      old->etcd_gogc = report->etcd_gogc;
      print(n, *old, &*report);
    }
  }
  return rc;
}

}  // namespace

void RegisterSimCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<SimArgs>();
  CLI::App* cmd = app.add_subcommand(
      "sim", "Simulate many nodes' rendezvous in one process and measure how it scales");
  cmd->add_option("--nodes", args->nodes, "node counts to run, comma separated (e.g. 100,500,1000)");
  OptionWithEnv(cmd, "--etcd", args->etcd, "etcd endpoints HOST:PORT[,...] (default: a private etcd)",
                envvar::kEtcdEndpoints);
  cmd->add_flag("--json", args->json, "one JSON object per node count");
  cmd->add_option("--ttl", args->ttl_s, "lease TTL of each simulated node, seconds");
  cmd->add_option("--liveness-window-ms", args->liveness_ms,
                  "how long a proposal waits for missing acks after the last one came");
  cmd->add_option("--seed", args->seed, "random seed for choosing the nodes to kill");
  cmd->add_option("--driver-threads", args->driver_threads,
                  "threads that drive all simulated nodes (0: one thread per node, the first "
                  "simulator)");
  cmd->add_option("--clients", args->clients,
                  "etcd connections the simulated nodes share (each with its own watch and "
                  "keep-alive stream)");
  cmd->add_option("--join-threads", args->join_threads,
                  "nodes that join at the same time while the job forms");
  cmd->add_option("--compare-max", args->compare_max,
                  "also run the thread-per-node simulator at node counts up to this (0: never), "
                  "and print its figures with the ratio to the pool's");
  cmd->callback([args, &runner] { runner.Set([args] { return RunSim(*args); }); });
}

}  // namespace efdl::cli
