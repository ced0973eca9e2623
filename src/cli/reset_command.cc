// `efdl reset --job ID [--etcd ...] [--snapshot-dir DIR]`: start a job over. A job id that ran
// before continues from its snapshots (and a completed one runs nothing); reset is how a user
// says "from the beginning" (issue #22). It loses no data: the snapshots are moved aside, not
// deleted. Refused while an agent of the job runs, or while a live process holds one of its
// shared-memory arenas on this host.
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/etcd_flags.h"
#include "common/env_names.h"
#include "efdl/etcd.h"
#include "rendezvous/ledger.h"
#include "rendezvous/protocol.h"
#include "snapshot/arena_dir.h"

namespace efdl::cli {

namespace {

struct ResetArgs {
  std::string job;
  std::string etcd;
  EtcdSecurityFlags etcd_security;
  std::string snapshot_dir = "efdl-snapshots";
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "efdl reset: error: %s\n", message.c_str());
  return code;
}

std::string UtcStamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// Removes the job's records from etcd (its secret stays: the job id keeps its identity).
// Refused while agents of the job are registered.
int ResetEtcd(const ResetArgs& args) {
  auto endpoints = etcd::ParseEndpoints(args.etcd);
  if (!endpoints.ok()) return Fail(2, "--etcd: " + endpoints.status().message());
  etcd::ClientOptions options;
  options.endpoints = *endpoints;
  if (Status st = ApplyEtcdSecurityFlags(args.etcd_security, &options); !st.ok()) {
    return Fail(2, st.message());
  }
  auto client = etcd::Connect(options);
  if (!client.ok()) return Fail(1, client.status().message());
  const rdzv::JobKeys keys(args.job);
  auto nodes = (*client)->Range(keys.nodes, {.prefix = true, .keys_only = true});
  if (!nodes.ok()) return Fail(1, nodes.status().message());
  if (!nodes->kvs.empty()) {
    std::vector<std::string> ids;
    for (const auto& kv : nodes->kvs) ids.push_back(kv.key.substr(keys.nodes.size()));
    return Fail(1, fmt::format("job '{}' is running: {} agent(s) registered ({}); stop them "
                               "first (`efdl suspend --job {}`, or stop the agents), then reset",
                               args.job, ids.size(), fmt::join(ids, ", "), args.job));
  }
  auto txn = (*client)->Txn(
      {}, {etcd::TxnOp::Delete(keys.round), etcd::TxnOp::Delete(keys.status),
           etcd::TxnOp::Delete(keys.complete), etcd::TxnOp::Delete(keys.assign, true),
           etcd::TxnOp::Delete(keys.ack, true), etcd::TxnOp::Delete(keys.suspended, true),
           etcd::TxnOp::Delete(keys.gaveup, true),
           etcd::TxnOp::Delete(keys.excluded, true),
           etcd::TxnOp::Delete(keys.compute, true), etcd::TxnOp::Delete(keys.stragglers),
           etcd::TxnOp::Delete(rdzv::LedgerPrefix(args.job), true),   // the goodput ledger
           etcd::TxnOp::Delete(keys.status + "/", true)});   // the status pages (status_pages.h)
  if (!txn.ok()) return Fail(1, txn.status().message());
  std::printf("removed job '%s' from etcd at %s (its round, completion, reports and goodput "
              "ledger)\n",
              args.job.c_str(), args.etcd.c_str());
  return 0;
}

int Reset(const ResetArgs& args) {
  if (Status st = rdzv::ValidateId("job id", args.job); !st.ok()) return Fail(2, st.message());
  // This host's arenas of the job: none may be in use.
  const std::string shm = snapshot::ShmDir(std::getenv(envvar::kShmDir));
  std::vector<std::string> arenas;
  uint64_t bytes = 0;
  for (const auto& e : snapshot::ScanArenaDir(shm, snapshot::HolderLockHeld)) {
    if (e.name.job != snapshot::SafeName(args.job)) continue;
    if (e.held) {
      return Fail(1, fmt::format("job '{}' is running on this host: a live process holds its "
                                 "shared-memory arena {} ({}); stop it first (`efdl suspend "
                                 "--job {}` for a job run with --etcd, or stop its agents / "
                                 "program), then reset",
                                 args.job, e.path, e.owner.empty() ? "owner unknown" : e.owner,
                                 args.job));
    }
    arenas.push_back(e.path);
    bytes += e.bytes;
  }
  if (!args.etcd.empty()) {
    if (int code = ResetEtcd(args); code != 0) return code;
  }
  const std::filesystem::path job_dir = std::filesystem::path(args.snapshot_dir) / args.job;
  std::error_code ec;
  if (std::filesystem::exists(job_dir, ec)) {
    const std::filesystem::path aside =
        std::filesystem::path(args.snapshot_dir) / fmt::format("{}.reset-{}", args.job, UtcStamp());
    std::filesystem::rename(job_dir, aside, ec);
    if (ec) {
      return Fail(1, fmt::format("cannot move {} aside to {}: {}", job_dir.string(),
                                 aside.string(), ec.message()));
    }
    std::printf("moved the job's snapshots %s -> %s (delete it once you no longer need them)\n",
                job_dir.string().c_str(), aside.string().c_str());
  } else {
    std::printf("no snapshots of job '%s' under %s\n", args.job.c_str(),
                args.snapshot_dir.c_str());
  }
  const auto removed = snapshot::RemoveArenas(shm, arenas, "");
  snapshot::RemoveOrphanLocks(shm);
  std::printf("removed %zu shared-memory arena(s) of the job from %s (%.1f MiB)\n",
              removed.size(), shm.c_str(), static_cast<double>(bytes) / (1 << 20));
  // Arenas are per host: another host's would be adopted by its next agent.
  std::printf("job '%s' starts from the beginning at its next run; on a job of several hosts, "
              "run `efdl reset --job %s` on each of them too (--etcd once is enough)\n",
              args.job.c_str(), args.job.c_str());
  return 0;
}

}  // namespace

void RegisterResetCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<ResetArgs>();
  CLI::App* cmd = app.add_subcommand(
      "reset",
      "Start a job over: remove its records from etcd (with --etcd), move its snapshots aside, "
      "remove this host's arenas of it");
  OptionWithEnv(cmd, "--job", args->job, "the job id", envvar::kJobId)->required();
  OptionWithEnv(cmd, "--etcd", args->etcd,
                "etcd endpoints of a job run with --etcd (none: a job without etcd)",
                envvar::kEtcdEndpoints);
  AddEtcdSecurityFlags(cmd, args->etcd_security);
  OptionWithEnv(cmd, "--snapshot-dir", args->snapshot_dir, "snapshot storage directory",
                envvar::kSnapshotDir)
      ->capture_default_str();
  cmd->callback([args, &runner] { runner.Set([args] { return Reset(*args); }); });
}

}  // namespace efdl::cli
