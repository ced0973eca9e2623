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

  int rc = 0;
  for (int n : sizes) {
    rdzv::SimOptions o;
    o.job_id = fmt::format("sim-{}", n);
    o.nodes = n;
    o.ttl = std::chrono::milliseconds(static_cast<int64_t>(args.ttl_s * 1000));
    o.liveness_window = std::chrono::milliseconds(args.liveness_ms);
    o.seed = args.seed;
    auto report = rdzv::RunScaleSim(**client, o);
    if (!report.ok()) return Fail(1, report.status().message());
    if (args.json) {
      std::printf("%s\n", report->ToJson().c_str());
    } else {
      std::printf("N = %d (one process, one shared etcd client, etcd %s)\n", n,
                  embedded ? "private" : args.etcd.c_str());
      std::printf("  baseline: %d concurrent puts seen by one watch in %.3f s (ratio below: "
                  "scenario / baseline)\n", n, report->baseline_seconds);
      std::printf("  %-28s %8s %7s %10s %12s %12s %14s\n", "scenario", "seconds", "ratio",
                  "requests", "bytes", "watch evts", "cpu ms/node");
      for (const auto& s : report->scenarios) {
        std::printf("  %-28s %8.3f %7.1f %10lld %12lld %12lld %14.3f%s\n", s.name.c_str(),
                    s.seconds, s.seconds / std::max(1e-9, report->baseline_seconds),
                    static_cast<long long>(s.requests), static_cast<long long>(s.bytes),
                    static_cast<long long>(s.watch_events), s.agent_cpu_ms_per_node,
                    s.ok ? "" : ("  FAILED: " + s.error).c_str());
      }
      std::printf("  steady: %.4f %% of a core per node, %lld requests per node per minute "
                  "(plus lease keep-alives on the shared stream)\n",
                  report->steady_cpu_percent_per_node,
                  static_cast<long long>(report->steady_requests_per_node_per_min));
    }
    std::fflush(stdout);
    for (const auto& s : report->scenarios) rc = s.ok ? rc : 1;
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
                "EFDL_ETCD_ENDPOINTS");
  cmd->add_flag("--json", args->json, "one JSON object per node count");
  cmd->add_option("--ttl", args->ttl_s, "lease TTL of each simulated node, seconds");
  cmd->add_option("--liveness-window-ms", args->liveness_ms,
                  "how long a proposal waits for missing acks after the last one came");
  cmd->add_option("--seed", args->seed, "random seed for choosing the nodes to kill");
  cmd->callback([args, &runner] { runner.Set([args] { return RunSim(*args); }); });
}

}  // namespace efdl::cli
