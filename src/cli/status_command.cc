// `efdl status`: a job's members, standbys, round and recent events, read from etcd.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/etcd_flags.h"
#include "cli/slurm_job.h"
#include "common/env_names.h"
#include "efdl/etcd.h"
#include "rendezvous/job_status.h"
#include "rendezvous/ledger.h"
#include "rendezvous/protocol.h"

namespace efdl::cli {

namespace {

struct StatusArgs {
  std::string etcd;
  EtcdSecurityFlags etcd_security;
  std::string job;
  bool json = false;
  bool prometheus_targets = false;
};

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int Fail(const char* command, int code, const std::string& message) {
  std::fprintf(stderr, "efdl %s: error: %s\n", command, message.c_str());
  return code;
}

// What `efdl status` and `efdl events` share: their arguments checked (exit 2 before etcd is
// contacted, like every other usage error) and the connection (exit 1 when etcd cannot be
// reached). On failure the message is printed and `exit_code` says the status.
struct JobClient {
  std::unique_ptr<etcd::Client> client;
  int exit_code = 0;
};

JobClient ConnectForJob(const StatusArgs& args, const char* command, const char* kept) {
  auto fail = [command](int code, const std::string& message) {
    return JobClient{nullptr, Fail(command, code, message)};
  };
  if (args.job.empty()) return fail(2, kJobIdMissing);
  if (args.etcd.empty()) {
    return fail(2, fmt::format("--etcd HOST:PORT is required (or set EFDL_ETCD_ENDPOINTS): a "
                               "job run without --etcd keeps its {} in a private etcd nobody "
                               "else can read", kept));
  }
  auto endpoints = etcd::ParseEndpoints(args.etcd);
  if (!endpoints.ok()) return fail(2, "--etcd: " + endpoints.status().message());
  if (Status st = rdzv::ValidateId("job id", args.job); !st.ok()) return fail(2, st.message());
  etcd::ClientOptions options;
  options.endpoints = *endpoints;
  if (Status st = ApplyEtcdSecurityFlags(args.etcd_security, &options); !st.ok()) {
    return fail(2, st.message());
  }
  auto client = etcd::Connect(options);
  if (!client.ok()) {
    return fail(1, fmt::format("cannot reach etcd at {}: {}", args.etcd,
                               client.status().message()));
  }
  return JobClient{std::move(client).value(), 0};
}

int ShowStatus(const StatusArgs& args) {
  JobClient c = ConnectForJob(args, "status", "state");
  if (!c.client) return c.exit_code;
  auto status = rdzv::ReadJobStatus(*c.client, args.job);
  if (!status.ok()) return Fail("status", 1, status.status().message());
  if (!status->exists && !args.json && !args.prometheus_targets) {  // one line, not a table saying the same first
    return Fail("status", 1,
                fmt::format("no job '{}' in etcd at {}: no node has registered it; check "
                            "--job and --etcd",
                            args.job, args.etcd));
  }
  std::string text = args.prometheus_targets ? status->PrometheusTargets() + "\n"
                     : args.json              ? status->ToJson() + "\n"
                                              : status->ToText();
  if (status->exists && !args.prometheus_targets) {
    // The goodput ledger: its summary and last events (all of them: `efdl events`).
    auto ledger = rdzv::ReadLedger(*c.client, args.job, WallSeconds());
    if (!ledger.ok()) {
      std::fprintf(stderr, "efdl status: warning: %s\n", ledger.status().message().c_str());
    } else if (args.json) {
      auto j = nlohmann::json::parse(status->ToJson());
      j["ledger"] = nlohmann::json::parse(ledger->ToJson());
      text = j.dump(1) + "\n";
    } else {
      text += ledger->ToText(/*last_events=*/3);
    }
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  if (!status->exists) return 1;  // --json: the object says exists=false
  return 0;
}

// `efdl events`: every event of the job's goodput ledger with its phases, and the goodput.
int ShowEvents(const StatusArgs& args) {
  JobClient c = ConnectForJob(args, "events", "ledger");
  if (!c.client) return c.exit_code;
  auto ledger = rdzv::ReadLedger(*c.client, args.job, WallSeconds());
  if (!ledger.ok()) return Fail("events", 1, ledger.status().message());
  if (ledger->totals.wall_s <= 0 && !args.json) {
    return Fail("events", 1,
                fmt::format("job '{}' has no ledger in etcd at {}: no round of it has "
                            "trained yet (or it was reset); check --job and --etcd",
                            args.job, args.etcd));
  }
  const std::string text = args.json ? ledger->ToJson() + "\n"
                                     : ledger->ToText(ledger->events.size());
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace

void RegisterEventsCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* cmd = app.add_subcommand(
      "events", "List a job's events (crashes, joins, leaves, hangs, suspends) with the phases "
                "of each pause, and its goodput");
  OptionWithEnv(cmd, "--etcd", args->etcd, "etcd endpoints HOST:PORT[,HOST:PORT...]",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(cmd, args->etcd_security);
  OptionWithEnv(cmd, "--job", args->job,
                "the job id (inside a Slurm job: slurm-$SLURM_JOB_ID by default)", envvar::kJobId);
  cmd->add_flag("--json", args->json, "one JSON object instead of text");
  cmd->callback([args, &runner] {
    if (args->job.empty()) args->job = SlurmJobIdFromEnv();
    runner.Set([args] { return ShowEvents(*args); });
  });
}

void RegisterStatusCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* cmd = app.add_subcommand("status", "Show a job's nodes, round and recent events");
  OptionWithEnv(cmd, "--etcd", args->etcd, "etcd endpoints HOST:PORT[,HOST:PORT...]",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(cmd, args->etcd_security);
  OptionWithEnv(cmd, "--job", args->job,
                "the job id (inside a Slurm job: slurm-$SLURM_JOB_ID by default)", envvar::kJobId);
  auto* json = cmd->add_flag("--json", args->json, "one JSON object instead of a table");
  cmd->add_flag("--prometheus-targets", args->prometheus_targets,
                "the nodes' metrics endpoints as a Prometheus file_sd target list (JSON), for "
                "a scrape config's file_sd_configs (deploy/prometheus)")
      ->excludes(json);
  cmd->callback([args, &runner] {
    if (args->job.empty()) args->job = SlurmJobIdFromEnv();
    runner.Set([args] { return ShowStatus(*args); });
  });
}

}  // namespace efdl::cli
