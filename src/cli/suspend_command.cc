// `efdl suspend --job ID` and `efdl resume --job ID` (EFDL-SPEC section 4). Suspend marks the
// job in etcd (rendezvous/suspend.h), then waits, bounded, until every agent of the job stopped
// its workers, recorded its persisted step and left; resume clears the mark so that agents
// started again continue from that step.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/etcd_flags.h"
#include "cli/slurm_job.h"
#include "common/env_names.h"
#include "efdl/etcd.h"
#include "rendezvous/suspend.h"

namespace efdl::cli {

namespace {

struct SuspendArgs {
  std::string etcd;
  EtcdSecurityFlags etcd_security;
  std::string job;
  double timeout_s = 300;
  bool no_wait = false;
};

int Fail(const char* command, int code, const std::string& message) {
  std::fprintf(stderr, "efdl %s: error: %s\n", command, message.c_str());
  return code;
}

// Connects to --etcd; on failure prints the error and sets `code`.
std::unique_ptr<etcd::Client> ConnectOrFail(const char* command, const SuspendArgs& args,
                                            int& code) {
  if (args.job.empty()) {
    code = Fail(command, 2, kJobIdMissing);
    return nullptr;
  }
  if (args.etcd.empty()) {
    code = Fail(command, 2,
                "--etcd HOST:PORT is required (or set EFDL_ETCD_ENDPOINTS): a job run without "
                "--etcd keeps its state in a private etcd that ends with its agent (stop that "
                "agent with Ctrl-C instead; it resumes from its last snapshot when run again)");
    return nullptr;
  }
  auto endpoints = etcd::ParseEndpoints(args.etcd);
  if (!endpoints.ok()) {
    code = Fail(command, 2, "--etcd: " + endpoints.status().message());
    return nullptr;
  }
  etcd::ClientOptions options;
  options.endpoints = *endpoints;
  if (Status st = ApplyEtcdSecurityFlags(args.etcd_security, &options); !st.ok()) {
    code = Fail(command, 2, st.message());
    return nullptr;
  }
  auto client = etcd::Connect(options);
  if (!client.ok()) {
    code = Fail(command, 1, fmt::format("cannot reach etcd at {}: {}", args.etcd,
                                        client.status().message()));
    return nullptr;
  }
  return std::move(client).value();
}


int RunSuspend(const SuspendArgs& args) {
  if (!(args.timeout_s > 0)) {
    return Fail("suspend", 2, "--timeout must be a positive number of seconds");
  }
  int code = 0;
  auto client = ConnectOrFail("suspend", args, code);
  if (!client) return code;
  auto marked = rdzv::MarkSuspended(*client, args.job);
  if (!marked.ok()) {
    return Fail("suspend", 1, marked.status().message());
  }
  if (marked->already) {
    std::printf("job %s was already suspended\n", args.job.c_str());
  } else {
    std::printf("job %s: marked suspended in round %lld; waiting for its agents to stop\n",
                args.job.c_str(), static_cast<long long>(marked->round));
  }
  std::fflush(stdout);
  if (args.no_wait) return 0;

  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  Result<rdzv::SuspensionInfo> info = rdzv::ReadSuspension(*client, args.job);
  while (true) {
    if (!info.ok()) return Fail("suspend", 1, info.status().message());
    if (!info->suspended()) {
      return Fail("suspend", 1, fmt::format("job {} is no longer suspended (`efdl resume` ran "
                                            "meanwhile?): it is {}",
                                            args.job, rdzv::PhaseName(info->phase)));
    }
    if (info->live_nodes.empty()) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      return Fail("suspend", 1, fmt::format(
          "job {} is marked suspended, but after {} s {} agent(s) still run ({}): workers stop "
          "at their next commit() or after the agents' --stop-grace; check `efdl status --job "
          "{}` and the agents' logs",
          args.job, args.timeout_s, info->live_nodes.size(), fmt::join(info->live_nodes, ", "),
          args.job));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    info = rdzv::ReadSuspension(*client, args.job);
  }
  for (const auto& [node, report] : info->reports) {
    std::printf("  node %-24s persisted %s\n", node.c_str(),
                report.step ? rdzv::DescribeSuspendPoint(report).c_str() : "nothing");
  }
  if (info->point) {
    // The snapshot the job resumes from: the newest by commit sequence, not the largest step.
    std::printf("job %s suspended at %s; `efdl resume --job %s` continues from there\n",
                args.job.c_str(), rdzv::DescribeSuspendPoint(*info->point).c_str(),
                args.job.c_str());
  } else {
    std::printf("job %s suspended; no agent found a persisted snapshot of it (it had not "
                "committed one yet, or no agent was running): when resumed it starts from the "
                "newest snapshot in storage, if any, else from the beginning\n",
                args.job.c_str());
  }
  return 0;
}

int RunResume(const SuspendArgs& args) {
  int code = 0;
  auto client = ConnectOrFail("resume", args, code);
  if (!client) return code;
  auto step = rdzv::ResumeJob(*client, args.job);
  if (!step.ok()) return Fail("resume", 1, step.status().message());
  std::printf("job %s resumed%s: start its agents again (`efdl run --etcd %s --job %s ...`)\n",
              args.job.c_str(),
              step->has_value() ? fmt::format(" (suspended at step {})", **step).c_str() : "",
              args.etcd.c_str(), args.job.c_str());
  return 0;
}

CLI::App* AddCommon(CLI::App& app, const char* name, const char* help, SuspendArgs& args) {
  CLI::App* cmd = app.add_subcommand(name, help);
  OptionWithEnv(cmd, "--etcd", args.etcd, "etcd endpoints HOST:PORT[,HOST:PORT...]",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(cmd, args.etcd_security);
  OptionWithEnv(cmd, "--job", args.job,
                "the job id (inside a Slurm job: slurm-$SLURM_JOB_ID by default)", envvar::kJobId);
  return cmd;
}

}  // namespace

void RegisterSuspendCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<SuspendArgs>();
  CLI::App* cmd = AddCommon(app, "suspend",
                            "Stop a job after its workers snapshot; `efdl resume` continues it",
                            *args);
  cmd->add_option("--timeout", args->timeout_s,
                  "seconds to wait for the agents to stop (default 300)");
  cmd->add_flag("--no-wait", args->no_wait, "mark the job suspended and return at once");
  cmd->callback([args, &runner] {
    if (args->job.empty()) args->job = SlurmJobIdFromEnv();
    runner.Set([args] { return RunSuspend(*args); });
  });
}

void RegisterResumeCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<SuspendArgs>();
  CLI::App* cmd = AddCommon(app, "resume",
                            "Clear a job's suspension; its agents started again continue it",
                            *args);
  cmd->callback([args, &runner] {
    if (args->job.empty()) args->job = SlurmJobIdFromEnv();
    runner.Set([args] { return RunResume(*args); });
  });
}

}  // namespace efdl::cli
