// `efdl dashboard`: serves one self-contained page showing a job live (docs/operations.md
// "Dashboard"): its nodes and ranks, round, world size, a throughput timeline with the events
// drawn over it, recent events, and nodes that gave up or were excluded. Runs until SIGINT or
// SIGTERM. Exit codes: 0 stopped on request, 1 etcd unreachable or the port cannot be bound,
// 2 bad input.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/etcd_flags.h"
#include "cli/slurm_job.h"
#include "common/env_names.h"
#include "dashboard/dashboard.h"
#include "efdl/etcd.h"
#include "rendezvous/job_status.h"
#include "rendezvous/protocol.h"

namespace efdl::cli {

namespace {

struct DashboardArgs {
  std::string etcd;
  EtcdSecurityFlags etcd_security;
  std::string job;
  std::string bind = "127.0.0.1";
  int port = dashboard::kDefaultPort;
  double poll = 1.0;
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "efdl dashboard: error: %s\n", message.c_str());
  return code;
}

int RunDashboard(const DashboardArgs& args) {
  if (args.job.empty()) return Fail(2, kJobIdMissing);
  if (args.etcd.empty()) {
    return Fail(2, "--etcd HOST:PORT is required (or set EFDL_ETCD_ENDPOINTS): the dashboard "
                   "reads the job from the etcd its agents use");
  }
  auto endpoints = etcd::ParseEndpoints(args.etcd);
  if (!endpoints.ok()) return Fail(2, "--etcd: " + endpoints.status().message());
  if (Status st = rdzv::ValidateId("job id", args.job); !st.ok()) return Fail(2, st.message());
  if (args.port < 0 || args.port > 65535) {
    return Fail(2, fmt::format("--port {} is not a port: give 1-65535, or 0 for any free port",
                               args.port));
  }
  {
    in_addr v4{};
    in6_addr v6{};
    const bool is_v6 = ::inet_pton(AF_INET6, args.bind.c_str(), &v6) == 1;
    if (::inet_pton(AF_INET, args.bind.c_str(), &v4) != 1 &&
        !(is_v6 && dashboard::HttpServerSupportsIpv6())) {
      return Fail(2, fmt::format("--bind '{}' is not {}: give 127.0.0.1 (this host only, the "
                                 "default), 0.0.0.0 (every interface) or one of this host's "
                                 "addresses",
                                 args.bind,
                                 is_v6 ? "usable: this build's HTTP server (civetweb) has no IPv6"
                                       : "a numeric IPv4 address"));
    }
  }
  if (!(args.poll >= 0.2 && args.poll <= 60)) {
    return Fail(2, "--poll must be from 0.2 to 60 seconds");
  }
  etcd::ClientOptions options;
  options.endpoints = *endpoints;
  if (Status st = ApplyEtcdSecurityFlags(args.etcd_security, &options); !st.ok()) {
    return Fail(2, st.message());
  }

  // Before any thread exists (gRPC's, civetweb's, the poller's): every thread inherits the
  // mask, and only sigtimedwait below takes the stop signals.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGHUP);
  ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);   // a browser that goes away mid-answer

  auto client = etcd::Connect(options);
  if (!client.ok()) {
    return Fail(1, fmt::format("cannot reach etcd at {}: {}", args.etcd,
                               client.status().message()));
  }
  // One read first: an etcd that refuses it is an error now, not a page that says so.
  auto first = rdzv::ReadJobStatus(**client, args.job);
  if (!first.ok()) {
    return Fail(1, fmt::format("cannot read job {} from etcd at {}: {}", args.job, args.etcd,
                               first.status().message()));
  }
  dashboard::DashboardOptions dopts;
  dopts.job_id = args.job;
  dopts.etcd = args.etcd;
  dopts.bind = args.bind;
  dopts.port = args.port;
  dopts.poll_interval_s = args.poll;
  auto dash = dashboard::Dashboard::Start(dopts, std::move(*client));
  if (!dash.ok()) {
    return Fail(1, fmt::format("{}; pick another with --port (0: any free port) or --bind",
                               dash.status().message()));
  }
  const std::string host = args.bind.find(':') != std::string::npos ? "[" + args.bind + "]"
                           : args.bind == "0.0.0.0" ? "127.0.0.1"
                                                    : args.bind;
  std::printf("efdl dashboard: job %s at http://%s:%d/ (listening on %s; Ctrl-C stops it)\n",
              args.job.c_str(), host.c_str(), (*dash)->port(), args.bind.c_str());
  if (!first->exists) {
    std::printf("efdl dashboard: no node has registered job '%s' in etcd at %s yet; the page "
                "fills in once one does\n",
                args.job.c_str(), args.etcd.c_str());
  }
  std::fflush(stdout);
  while (true) {
    int sig = sigwaitinfo(&stop_signals, nullptr);
    if (sig > 0) {
      std::fprintf(stderr, "efdl dashboard: stopping (%s)\n", strsignal(sig));
      dash->reset();
      return 0;
    }
    if (errno != EINTR) return Fail(1, std::string("sigwaitinfo failed: ") + strerror(errno));
  }
}

}  // namespace

void RegisterDashboardCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<DashboardArgs>();
  CLI::App* cmd = app.add_subcommand(
      "dashboard",
      "Serve a live page of a job: nodes and ranks, round, world size, throughput timeline "
      "with events (one self-contained page; nothing fetched from elsewhere)");
  OptionWithEnv(cmd, "--etcd", args->etcd, "etcd endpoints HOST:PORT[,HOST:PORT...]",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(cmd, args->etcd_security);
  OptionWithEnv(cmd, "--job", args->job,
                "the job id (inside a Slurm job: slurm-$SLURM_JOB_ID by default)", envvar::kJobId);
  cmd->add_option("--port", args->port, "HTTP port of the page (0: any free port)")
      ->capture_default_str();
  cmd->add_option("--bind", args->bind,
                  "IPv4 address to listen on; the default serves this host only (the page has no "
                  "authentication): 0.0.0.0 opens it to the network")
      ->capture_default_str();
  cmd->add_option("--poll", args->poll,
                  "seconds between two reads of etcd and of the nodes' metrics endpoints")
      ->capture_default_str();
  cmd->callback([args, &runner] {
    if (args->job.empty()) args->job = SlurmJobIdFromEnv();
    runner.Set([args] { return RunDashboard(*args); });
  });
}

}  // namespace efdl::cli
