// `efdl snapshots list|show|verify|prune --job ID [--snapshot-dir DIR]`: inspect and tidy a job's
// persisted snapshots (<snapshot-dir>/<job>/snap-*.efdl, and rank-<N>/ for per-rank snapshots).
// `efdl snapshots list` without --job: this host's shared-memory arenas (EFDL_SHM_DIR), with
// size, job and owner; `efdl snapshots gc`: removes the arenas no live process holds
// (snapshot/arena_dir.h, docs/snapshots.md "Arena lifecycle") and the data directories of private
// etcds whose owning command died (etcd/private_dirs.h, docs/operations.md "Private etcd").
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agent/stale_dirs.h"
#include "cli/commands.h"
#include "common/env_names.h"
#include "etcd/private_dirs.h"
#include "snapshot/arena_dir.h"
#include "snapshot/env.h"
#include "snapshot/parallel.h"
#include "snapshot/scope.h"
#include "snapshot/store.h"

namespace efdl::cli {

namespace {

namespace snap = efdl::snapshot;

struct SnapshotsArgs {
  std::string job;
  std::string dir = "efdl-snapshots";
  bool json = false;
  int64_t seq = -1;
  int keep = 2;
  bool dry_run = false;
};

// The job's directory and its per-rank subdirectories, each a store of its own
// (snapshot/scope.h).
std::vector<std::string> StoreDirs(const std::string& job_dir) {
  std::vector<std::string> dirs = {job_dir};
  for (std::string& dir : snap::RankStoreDirs(job_dir)) dirs.push_back(std::move(dir));
  return dirs;
}

std::string FormatTime(double wall) {
  std::time_t t = static_cast<std::time_t>(wall);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

int Fail(const std::string& line) {
  std::fprintf(stderr, "efdl snapshots: %s\n", line.c_str());
  return 1;
}

std::string Mib(uint64_t bytes) { return fmt::format("{:.1f}", static_cast<double>(bytes) / (1 << 20)); }

nlohmann::json ArenaRow(const snap::ArenaEntry& e) {
  nlohmann::json row = {{"path", e.path},   {"bytes", e.bytes}, {"job", e.job},
                        {"job_name", e.name.job}, {"holder", e.name.holder},
                        {"scope", e.name.scope}, {"live", e.held}, {"owner", e.owner}};
  if (e.newest_seq) row["seq"] = *e.newest_seq;
  if (e.newest_step) row["step"] = *e.newest_step;
  return row;
}

// This host's arenas (no --job), or `gc`.
int RunArenas(const std::string& action, const SnapshotsArgs& a) {
  const std::string dir = snap::ShmDir(std::getenv(envvar::kShmDir));
  if (!snap::Env::Posix()->FileExists(dir)) {
    return Fail(fmt::format("shared-memory directory {} does not exist (EFDL_SHM_DIR)", dir));
  }
  auto entries = snap::ScanArenaDir(dir, snap::HolderLockHeld);
  if (action == "gc") {
    // The private etcd directories of dead commands (#38): in TMPDIR, not the arena directory.
    const std::string tmp = etcd::TempBase();
    const auto etcd_dirs = etcd::RemoveStalePrivateEtcdDirs(tmp, a.dry_run);
    uint64_t etcd_bytes = 0;
    std::vector<std::string> etcd_paths;
    for (const auto& d : etcd_dirs) {
      etcd_bytes += d.bytes;
      etcd_paths.push_back(d.path);
    }
    // The control-socket directories of SIGKILLed agents (agent/stale_dirs.h), which otherwise
    // only the next `efdl run` on this host removes (#36: a node's last step after scancel).
    const int agent_dirs = a.dry_run ? 0 : agent::RemoveStaleAgentDirs(tmp);
    auto plan = snap::PlanGc(entries, "");
    uint64_t freed = 0;
    std::vector<std::string> removed;
    if (a.dry_run) {
      removed = plan;
    } else {
      removed = snap::RemoveArenas(dir, plan, "");
      snap::RemoveOrphanLocks(dir);
    }
    for (const auto& e : entries) {
      if (std::find(removed.begin(), removed.end(), e.path) != removed.end()) freed += e.bytes;
    }
    if (a.json) {
      std::cout << nlohmann::json({{"removed", removed}, {"bytes", freed},
                                   {"etcd_dirs", etcd_paths}, {"etcd_bytes", etcd_bytes},
                                   {"agent_dirs", agent_dirs}, {"dry_run", a.dry_run}}).dump(2)
                << "\n";
    } else {
      for (const auto& p : removed) std::cout << (a.dry_run ? "would remove " : "removed ") << p << "\n";
      std::cout << fmt::format("{} {} arena(s), {} MiB, from {}; arenas a live process holds are "
                               "kept\n", a.dry_run ? "would remove" : "removed", removed.size(),
                               Mib(freed), dir);
      for (const auto& d : etcd_dirs) {
        std::cout << (a.dry_run ? "would remove " : "removed ") << d.path << " (" << d.why
                  << ")\n";
      }
      std::cout << fmt::format("{} {} private etcd director{}, {} MiB, from {}; those of running "
                               "commands are kept\n", a.dry_run ? "would remove" : "removed",
                               etcd_dirs.size(), etcd_dirs.size() == 1 ? "y" : "ies",
                               Mib(etcd_bytes), tmp);
      if (!a.dry_run) {
        std::cout << fmt::format("removed {} control-socket director{} of dead agents from {}\n",
                                 agent_dirs, agent_dirs == 1 ? "y" : "ies", tmp);
      }
    }
    return 0;
  }
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : entries) out.push_back(ArenaRow(e));
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format("{:>9} {:<6} {:>8} {:<24} {:<6} {:<30} {}\n", "MIB", "SCOPE", "STEP",
                           "JOB", "LIVE", "OWNER", "PATH");
  for (const auto& e : entries) {
    std::cout << fmt::format("{:>9} {:<6} {:>8} {:<24} {:<6} {:<30} {}\n", Mib(e.bytes),
                             e.name.scope, e.newest_step ? std::to_string(*e.newest_step) : "-",
                             e.job.empty() ? e.name.job : e.job, e.held ? "yes" : "no",
                             e.owner.empty() ? "-" : e.owner, e.path);
  }
  if (entries.empty()) std::cout << fmt::format("(no snapshot arenas in {})\n", dir);
  return 0;
}

int Run(const std::string& action, const SnapshotsArgs& a) {
  if (action == "gc" || (action == "list" && a.job.empty())) return RunArenas(action, a);
  if (a.job.empty() || a.job.find('/') != std::string::npos || a.job == "." || a.job == "..") {
    return Fail(fmt::format("--job '{}' is not a job id (no '/', not empty)", a.job));
  }
  const std::string job_dir = snap::JobStoreDir(a.dir, a.job);
  if (!snap::Env::Posix()->FileExists(job_dir)) {
    return Fail(fmt::format("no snapshots for job '{}' under {} (check --job and "
                            "--snapshot-dir / EFDL_SNAPSHOT_DIR)", a.job, a.dir));
  }
  snap::ParallelRunner runner(2);
  nlohmann::json out = nlohmann::json::array();
  int bad = 0, removed = 0, shown = 0;
  for (const auto& dir : StoreDirs(job_dir)) {
    snap::SnapshotStore store(snap::Env::Posix(), dir, a.keep);
    if (action == "prune") {
      auto r = store.Prune(a.keep);
      if (!r.ok()) return Fail(r.status().message());
      removed += *r;
      continue;
    }
    for (const auto& e : store.List()) {
      if (a.seq >= 0 && e.seq != static_cast<uint64_t>(a.seq)) continue;
      if (action == "show" && shown > 0 && a.seq < 0) break;  // newest only
      ++shown;
      auto info = store.ReadInfo(e.path);
      Status status = info.status();
      if (info.ok() && action == "verify") status = store.Verify(e.path, &runner);
      if (!status.ok()) ++bad;
      nlohmann::json row = {{"seq", e.seq}, {"path", e.path}, {"ok", status.ok()}};
      if (!status.ok()) row["error"] = status.message();
      if (info.ok()) {
        const auto& m = info->manifest;
        row["step"] = m.step;
        row["time"] = FormatTime(m.wall_time);
        row["scope"] = m.scope;
        row["bytes"] = info->file_bytes;
        row["format"] = info->format;
        row["tensors"] = m.tensors.size();
        if (action == "show") {
          auto meta = nlohmann::json::parse(m.meta_json, nullptr, false);
          row["values"] = meta.is_object() && meta.contains("kwargs") ? meta["kwargs"]
                                                                      : nlohmann::json{};
          nlohmann::json ts = nlohmann::json::array();
          for (const auto& t : m.tensors) {
            ts.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape},
                          {"nbytes", t.nbytes}});
          }
          row["tensor_list"] = std::move(ts);
        }
      }
      out.push_back(std::move(row));
    }
  }
  if (action == "prune") {
    std::printf("removed %d snapshot(s); kept the newest %d per directory\n", removed, a.keep);
    return 0;
  }
  if (out.empty()) {
    return Fail(a.seq >= 0 ? fmt::format("job '{}' has no snapshot with seq {}", a.job, a.seq)
                           : fmt::format("job '{}' has no snapshots in {}", a.job, job_dir));
  }
  if (a.json) {
    std::cout << out.dump(2) << "\n";
  } else if (action == "show") {
    for (const auto& r : out) {
      std::cout << fmt::format(
          "snapshot {}\n  seq {}  step {}  scope {}  written {}  {} bytes  format {}\n",
          r["path"].get<std::string>(), r["seq"].get<uint64_t>(), r.value("step", int64_t{0}),
          r.value("scope", ""), r.value("time", ""), r.value("bytes", uint64_t{0}),
          r.value("format", 0));
      if (!r["ok"].get<bool>()) {
        std::cout << "  DAMAGED: " << r["error"].get<std::string>() << "\n";
        continue;
      }
      std::cout << "  values: " << r["values"].dump() << "\n";
      std::cout << "  tensors (" << r["tensors"].get<size_t>() << "):\n";
      for (const auto& t : r["tensor_list"]) {
        std::cout << fmt::format("    {:<48} {:<9} {:<18} {} bytes\n",
                                 t["name"].get<std::string>(), t["dtype"].get<std::string>(),
                                 t["shape"].dump(), t["nbytes"].get<uint64_t>());
      }
    }
  } else {
    std::cout << fmt::format("{:>8} {:>10} {:<21} {:<7} {:>12}  {:<8} {}\n", "SEQ", "STEP",
                             "WRITTEN (UTC)", "SCOPE", "BYTES", "STATUS", "PATH");
    for (const auto& r : out) {
      std::cout << fmt::format("{:>8} {:>10} {:<21} {:<7} {:>12}  {:<8} {}\n",
                               r["seq"].get<uint64_t>(), r.value("step", int64_t{0}),
                               r.value("time", "-"), r.value("scope", "-"),
                               r.value("bytes", uint64_t{0}),
                               r["ok"].get<bool>() ? (action == "verify" ? "verified" : "ok")
                                                   : "DAMAGED",
                               r["path"].get<std::string>());
      if (!r["ok"].get<bool>()) std::cout << "         " << r["error"].get<std::string>() << "\n";
    }
  }
  return bad > 0 ? 1 : 0;
}

}  // namespace

void RegisterSnapshotsCommand(CLI::App& app, CommandRunner& runner) {
  auto* cmd = app.add_subcommand(
      "snapshots", "List, show, verify or prune a job's snapshots; list or gc this host's arenas");
  cmd->require_subcommand(1);
  auto args = std::make_shared<SnapshotsArgs>();
  struct Action {
    const char* name;
    const char* help;
  };
  for (const Action& act :
       {Action{"list", "List the job's snapshots, newest first (header checks only)"},
        Action{"show", "Show the newest snapshot (or --seq): values and tensors"},
        Action{"verify", "Verify every snapshot's checksums; exit 1 if any is damaged"},
        Action{"prune", "Remove all but the newest --keep snapshots"},
        Action{"gc", "Remove this host's shared-memory arenas that no live process holds "
                     "(EFDL_SHM_DIR) and the private etcd directories of dead commands "
                     "(TMPDIR/efdl-etcd-*)"}}) {
    auto* sub = cmd->add_subcommand(act.name, act.help);
    const std::string n = act.name;
    if (n == "gc") {
      sub->add_flag("--json", args->json, "Machine-readable output");
      sub->add_flag("--dry-run", args->dry_run, "Only say what would be removed");
      sub->callback([&runner, args] { runner.Set([args] { return Run("gc", *args); }); });
      continue;
    }
    auto* job = sub->add_option("--job", args->job,
                                n == "list" ? "Job id (without: this host's shared-memory arenas)"
                                            : "Job id");
    if (n != "list") job->required();
    job->envname(envvar::kJobId);
    OptionWithEnv(sub, "--snapshot-dir", args->dir, "Snapshot storage directory",
                  envvar::kSnapshotDir)
        ->capture_default_str();
    if (std::string(act.name) == "prune") {
      sub->add_option("--keep", args->keep, "Snapshots to keep")
          ->capture_default_str()
          ->check(CLI::PositiveNumber);
    } else {
      sub->add_flag("--json", args->json, "Machine-readable output");
      sub->add_option("--seq", args->seq, "Only the snapshot with this seq");
    }
    std::string name = act.name;
    sub->callback([&runner, args, name] { runner.Set([args, name] { return Run(name, *args); }); });
  }
}

}  // namespace efdl::cli
