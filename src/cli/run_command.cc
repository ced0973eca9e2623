// `efdl run`: the node agent. See `efdl run --help` and docs/control-protocol.md.
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "agent/agent.h"
#include "cli/run_config.h"
#include "cli/commands.h"
#include "cli/etcd_flags.h"
#include "cli/slurm_job.h"
#include "common/env_names.h"
#include "common/log.h"
#include "common/net.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "etcd/private_dirs.h"
#include "rendezvous/etcd_rendezvous.h"
#include "rendezvous/rendezvous.h"
#include "rendezvous/suspend.h"
#include "security/job_secret.h"

namespace efdl::cli {

namespace {

struct RunArgs {
  std::string etcd;
  EtcdSecurityFlags etcd_security;
  RunFlags flags;
  bool prestart_flag = false;     // --prestart or EFDL_PRESTART as given; read only when given
  bool no_prestart_flag = false;  // --no-prestart
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "efdl run: error: %s\n", message.c_str());
  return code;
}

// A pending SIGTERM/SIGINT, taken without blocking; both are blocked in every thread of the
// agent (the mask is set before any thread starts), so they wait here instead of killing us.
int TakePendingShutdownSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  timespec zero{0, 0};
  int sig = ::sigtimedwait(&set, nullptr, &zero);
  return sig > 0 ? sig : 0;
}

int RunAgent(const RunArgs& args) {
  RunFlags flags = args.flags;
  if (!args.etcd.empty()) {
    auto endpoints = etcd::ParseEndpoints(args.etcd);
    if (!endpoints.ok()) return Fail(2, "--etcd: " + endpoints.status().message());
    flags.etcd_endpoints = *endpoints;
  }
  auto plan = PlanRun(flags);
  if (!plan.ok()) return Fail(2, plan.status().message());

  // Before any thread exists (gRPC's, ours): every thread inherits the mask.
  sigset_t shutdown_signals;
  sigemptyset(&shutdown_signals);
  sigaddset(&shutdown_signals, SIGTERM);
  sigaddset(&shutdown_signals, SIGINT);
  ::pthread_sigmask(SIG_BLOCK, &shutdown_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  // Private etcd directories of commands that were killed along with their reaper (#38).
  etcd::RemoveStalePrivateEtcdDirs(etcd::TempBase());
  std::unique_ptr<EmbeddedEtcd> embedded;
  std::vector<std::string> endpoints = flags.etcd_endpoints;
  if (plan->embedded_etcd) {
    auto started = EmbeddedEtcd::Start({});
    if (!started.ok()) {
      return Fail(1, "cannot start the private etcd (no --etcd given): " +
                         started.status().message());
    }
    embedded = std::move(started).value();
    endpoints = {embedded->endpoint()};
    EFDL_LOG_INFO("no --etcd given: started a private etcd at {} for a single-node job",
                  embedded->endpoint());
  }
  // The metrics endpoint, announced in this node's record (started before the join) and told
  // of every etcd request.
  std::unique_ptr<metrics::AgentMetrics> node_metrics;
  std::string metrics_warning;   // said, like the rest, once etcd answered
  {
    auto started = metrics::AgentMetrics::Start(plan->metrics, plan->agent.job_id,
                                                plan->agent.node_id);
    if (!started.ok()) {
      // A port the user chose is theirs to fix; the default range being full costs only metrics.
      if (plan->metrics.mode == metrics::Listen::Mode::kPort) {
        return Fail(2, started.status().message());
      }
      metrics_warning = "running without metrics: " + started.status().message();
    } else if (*started) {
      node_metrics = std::move(started).value();
      const bool v6 = plan->network.address.find(':') != std::string::npos;
      plan->rendezvous.metrics_addr =
          v6 ? fmt::format("[{}]:{}", plan->network.address, node_metrics->port())
             : fmt::format("{}:{}", plan->network.address, node_metrics->port());
      plan->agent.metrics = node_metrics.get();
    }
  }
  etcd::ClientOptions client_options;
  client_options.observer = node_metrics.get();
  client_options.endpoints = endpoints;
  if (!embedded) {  // our private etcd is plaintext and has no users
    if (Status st = ApplyEtcdSecurityFlags(args.etcd_security, &client_options); !st.ok()) {
      return Fail(2, st.message());
    }
  }
  auto client = etcd::Connect(client_options);
  if (!client.ok()) {
    // The client's message names the endpoints and says to check that etcd runs there.
    return Fail(2, fmt::format("{}; the endpoints come from --etcd (or EFDL_ETCD_ENDPOINTS)",
                               client.status().message()));
  }
  // Said once etcd answered: an agent that cannot start prints its one error line only.
  const NetworkChoice& net = plan->network;
  EFDL_LOG_INFO("advertising {} on interface {} ({}){}", net.address,
                net.iface.empty() ? "(none found)" : net.iface, net.how,
                net.iface.empty() ? "" : "; workers get it as GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME "
                                         "unless set");
  if (!net.warning.empty()) EFDL_LOG_WARN("{}", net.warning);
  if (node_metrics) EFDL_LOG_INFO("metrics at http://{}/metrics", plan->rendezvous.metrics_addr);
  if (!metrics_warning.empty()) EFDL_LOG_WARN("{}", metrics_warning);
  auto secret = security::EnsureJobSecret(**client, plan->agent.job_id);
  if (!secret.ok()) return Fail(1, "job secret: " + secret.status().message());
  plan->agent.job_secret = std::move(secret).value();
  auto rendezvous = rdzv::NewEtcdRendezvous(**client, plan->rendezvous);
  plan->agent.poll_signal = TakePendingShutdownSignal;
  // A suspended job is refused, and a complete one starts no spares, before any worker is
  // pre-started (the join would say so only after the spares imported the program).
  plan->agent.check_before_start = [&client, job = plan->agent.job_id]() -> Status {
    auto info = rdzv::ReadSuspension(**client, job);
    if (!info.ok()) return Status::OK();  // the join reads it again and says what is wrong
    if (info->suspended()) {
      return Status::FailedPrecondition(rdzv::SuspendedJobMessage(job, info->point));
    }
    if (info->phase == rdzv::Phase::kComplete) return Status::AlreadyExists("complete");
    return Status::OK();
  };
  int code;
  {
    agent::Agent node(plan->agent, *rendezvous);
    code = node.Run();
  }
  rendezvous.reset();  // before the client it uses
  return code;
}

}  // namespace

void RegisterRunCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<RunArgs>();
  RunFlags& f = args->flags;
  CLI::App* run = app.add_subcommand(
      "run", "Run this node's share of an elastic job: efdl run [OPTIONS] -- COMMAND [ARGS...]");
  OptionWithEnv(run, "--etcd", args->etcd,
                "etcd endpoints HOST:PORT[,HOST:PORT...]; none: a private etcd, single node",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(run, args->etcd_security);
  OptionWithEnv(run, "--job", f.job_id,
                "job id shared by all nodes of the job (required with --etcd, except inside a "
                "Slurm job: slurm-$SLURM_JOB_ID; without --etcd: local-<script name>-<8 hex>, "
                "the program's own)",
                envvar::kJobId);
  OptionWithEnv(run, "--nnodes", f.nnodes,
                "nodes in the job: N or MIN:MAX (default 1:1; with --world-size N: 1:N)",
                "EFDL_NNODES");
  OptionWithEnv(run, "--world-size", f.world_size,
                "fragmented job: a round forms only when the members' processes add up to "
                "exactly N (nodes may differ in --nproc-per-node; extra nodes wait as standby)",
                "EFDL_WORLD_SIZE");
  run->add_flag("--launcher", f.launcher,
                "start ONE process per node that launches the node's workers itself (torchrun, "
                "accelerate, ...), with NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, "
                "MASTER_PORT, WORLD_SIZE, RANK in its environment")
      ->envname(envvar::kLauncher);
  OptionWithEnv(run, "--nproc-per-node", f.nproc_per_node,
                "worker processes on this node (default: visible GPUs, else 1)",
                "EFDL_NPROC_PER_NODE");
  OptionWithEnv(run, "--node-id", f.node_id,
                "this node's unique id (default: host name plus a unique suffix)",
                envvar::kNodeId);
  OptionWithEnv(run, "--advertise-addr", f.advertise_addr,
                "address of this host other nodes reach this one at (MASTER_ADDR when rank 0); "
                "default: the address this host reaches etcd from (127.0.0.1 for loopback etcd)",
                "EFDL_ADVERTISE_ADDR");
  OptionWithEnv(run, "--iface", f.iface,
                "network interface the nodes reach each other on: its address is advertised "
                "and workers get it as GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; default: the "
                "interface of the advertise address",
                "EFDL_IFACE");
  OptionWithEnv(run, "--ttl", f.ttl_s, "seconds before a silent node is declared dead",
                "EFDL_TTL");
  OptionWithEnv(run, "--last-call", f.last_call_s,
                "seconds to wait for more nodes once MIN are there", "EFDL_LAST_CALL");
  OptionWithEnv(run, "--join-timeout", f.join_timeout_s,
                "seconds to wait below MIN nodes before giving up", "EFDL_JOIN_TIMEOUT");
  OptionWithEnv(run, "--max-restarts", f.max_restarts,
                "this node's own worker failures after which it leaves the job for good, where "
                "it cannot be excluded instead (--exclude-after 0, or the job cannot go on "
                "without it: fewer than MIN other nodes)",
                "EFDL_MAX_RESTARTS");
  OptionWithEnv(run, "--exclude-after", f.exclude_after,
                "a node whose own workers failed this many times within --exclude-window "
                "(failures another node caused are not counted) is excluded from the job's "
                "rounds for --exclude-cooldown while the job can go on without it (MIN other "
                "nodes), then rejoins with fresh workers; 0: never excluded",
                "EFDL_EXCLUDE_AFTER");
  OptionWithEnv(run, "--exclude-window", f.exclude_window_s,
                "seconds over which --exclude-after counts a node's own failures",
                "EFDL_EXCLUDE_WINDOW");
  OptionWithEnv(run, "--exclude-cooldown", f.exclude_cooldown_s,
                "seconds an excluded node stays out of the job; doubles with each further "
                "exclusion of the same agent, up to 8x",
                "EFDL_EXCLUDE_COOLDOWN");
  OptionWithEnv(run, "--stop-grace", f.stop_grace_s,
                "seconds a stopping worker gets before SIGTERM, and again before SIGKILL",
                "EFDL_STOP_GRACE");
  OptionWithEnv(run, "--hang-timeout", f.hang_timeout,
                "seconds a rank may make no progress (State.commit(), efdl.progress()) before "
                "it is declared hung: its stack is logged and the node that caused the hang "
                "ends its workers; 0: off; auto: the larger of 180 s and 10x the slowest recent "
                "interval between progress reports (600 s before a round's first), and never "
                "for a program that does not report",
                "EFDL_HANG_TIMEOUT");
  OptionWithEnv(run, "--straggler-factor", f.straggler_factor,
                "a node is named a STRAGGLER when its slowest rank's compute time per step (up "
                "to its gradients being ready, not counting the wait for peers) is at least "
                "this many times the median of the other nodes' ranks, and 10 ms more, for "
                "--straggler-window: logged by node rank 0, shown by efdl status and the "
                "metrics (efdl_straggler); 0: off (also off without a progress board: "
                "--hang-timeout 0, --launcher)",
                envvar::kStragglerFactor);
  OptionWithEnv(run, "--straggler-window", f.straggler_window_s,
                "seconds a node must be slow before it is named a straggler: 3 summaries of a "
                "third of it each (at scale each summary takes at least nodes/100 s)",
                envvar::kStragglerWindow);
  run->add_flag("--evict-stragglers", f.evict_stragglers,
                "a node named a straggler leaves the job for --exclude-cooldown (doubling with "
                "each exclusion) while the job can go on without it (MIN other nodes), then "
                "rejoins; off by default")
      ->envname(envvar::kEvictStragglers);
  OptionWithEnv(run, "--metrics-port", f.metrics_port,
                "port of this node's Prometheus metrics (http://ADDRESS:PORT/metrics, listed by "
                "efdl status); auto: 9441, or the next free port up to 9472 when several agents "
                "share a host; 0: any free port; off: none",
                "EFDL_METRICS_PORT");
  OptionWithEnv(run, "--log-dir", f.log_dir,
                "also write each worker's output to DIR/<node id>/round-R.rank-N.log",
                "EFDL_LOG_DIR");
  OptionWithEnv(run, "--snapshot-dir", f.snapshot_dir,
                "snapshot storage given to workers as EFDL_SNAPSHOT_DIR", envvar::kSnapshotDir);
  // Two flags rather than CLI11's "--prestart,!--no-prestart", whose help reads
  // "--no-prestart{false}" as if the feature were off by default.
  CLI::Option* prestart =
      run->add_flag("--prestart", args->prestart_flag,
                    "keep one pre-started interpreter per local rank (torch imported) and use "
                    "it for the next round's worker (faster re-rounds); default (neither flag): "
                    "on for 'python3 SCRIPT'/'python3 -m MODULE' commands, off for others; "
                    "--prestart refuses other commands")
          ->envname("EFDL_PRESTART");
  CLI::Option* no_prestart =
      run->add_flag("--no-prestart", args->no_prestart_flag,
                    "always spawn each round's workers (no pre-started interpreters)");
  prestart->excludes(no_prestart);
  run->add_flag("--no-zygote", f.no_zygote,
                "start each pre-started interpreter on its own instead of forking it from the "
                "node's zygote (one interpreter that imported once)");
  run->add_flag("--no-learn-imports", f.no_learn_imports,
                "the zygote imports only EFDL_PRELOAD_MODULES, not also the installed modules "
                "the program's workers imported")
      ->envname("EFDL_NO_LEARN_IMPORTS");
  OptionWithEnv(run, "--resume-args", f.resume_args,
                "arguments appended to the command on every start that resumes the job (a "
                "round after the job's first: after a crash, join, leave, suspend or restart), "
                "split at spaces, e.g. \"--init_from=resume\"; pre-started workers are kept",
                "EFDL_RESUME_ARGS");
  run->add_flag("--horovod", f.horovod,
                "an unmodified 'import horovod.torch as hvd' gets EFDL's Horovod layer (refused "
                "when a real Horovod is installed)")
      ->envname("EFDL_RUN_HOROVOD");
  // The defaults as the flags hold them, shown in --help as [VALUE] (docs/agent.md lists them;
  // tests/python/test_e2e_cli.py checks that the two agree).
  for (const char* name : {"--ttl", "--last-call", "--join-timeout", "--max-restarts",
                           "--exclude-after", "--exclude-window", "--exclude-cooldown",
                           "--stop-grace", "--hang-timeout", "--straggler-factor",
                           "--straggler-window", "--metrics-port", "--snapshot-dir"}) {
    run->get_option(name)->capture_default_str();
  }
  run->add_option("command", f.command, "the training command, after --")->expected(-1);
  run->callback([args, prestart, no_prestart, &runner] {
    // Inside a Slurm allocation every step and node, and the job requeued, share SLURM_JOB_ID.
    if (args->flags.job_id.empty()) args->flags.job_id = SlurmJobIdFromEnv();
    // Neither flag nor EFDL_PRESTART (CLI11 counts an environment value as a use): auto.
    args->flags.prestart = no_prestart->count() > 0 ? PrestartMode::kOff
                           : prestart->count() == 0 ? PrestartMode::kAuto
                           : args->prestart_flag    ? PrestartMode::kOn
                                                    : PrestartMode::kOff;
    runner.Set([args] { return RunAgent(*args); });
  });
}

}  // namespace efdl::cli
