// NodeSnapshots (node_snapshots.h): the holder lock, the persister, flushes, arena removal and
// the newest stored point of this node.
#include "agent/node_snapshots.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "common/env_names.h"
#include "common/log.h"
#include "common/net.h"
#include "snapshot/scope.h"
#include "snapshot/store.h"

namespace efdl::agent {

std::optional<rdzv::PersistedPoint> NewestStoredPoint(const std::string& snapshot_dir,
                                                      const std::string& job_id) {
  if (snapshot_dir.empty()) return std::nullopt;
  auto newest_in = [](const std::string& dir) -> std::optional<rdzv::PersistedPoint> {
    snapshot::SnapshotStore store(snapshot::Env::Posix(), dir, /*keep=*/1);
    for (const auto& entry : store.List()) {
      auto info = store.ReadInfo(entry.path);
      if (info.ok()) {
        rdzv::PersistedPoint p{info->manifest.seq, info->manifest.step, std::nullopt};
        auto meta = nlohmann::json::parse(info->manifest.meta_json, nullptr, false);
        // python/efdl/_manifest.py keeps the keyword arguments under "kwargs" (JSON-exact ones;
        // the rest are pickled and not read here).
        if (meta.is_object() && meta.contains("kwargs") && meta["kwargs"].is_object()) {
          const auto& kwargs = meta["kwargs"];
          if (kwargs.contains("epoch") && kwargs["epoch"].is_number_integer()) {
            p.epoch = kwargs["epoch"].get<int64_t>();
          }
        }
        return p;
      }
      EFDL_LOG_WARN("skipping snapshot {}: {}", entry.path, info.status().message());
    }
    return std::nullopt;
  };
  const std::string job_dir = snapshot::JobStoreDir(snapshot_dir, job_id);
  if (auto point = newest_in(job_dir)) return point;
  std::optional<rdzv::PersistedPoint> oldest_rank;
  for (const std::string& dir : snapshot::RankStoreDirs(job_dir)) {
    auto point = newest_in(dir);
    if (!point) return std::nullopt;  // a rank without a snapshot: the job has none complete
    if (!oldest_rank || point->seq < oldest_rank->seq) oldest_rank = point;
  }
  return oldest_rank;
}

NodeSnapshots::~NodeSnapshots() {
  persister_.reset();
  if (holder_lock_) {
    // The lock file stays only while arenas of this holder do (for the next agent to adopt).
    holder_lock_.reset();
    snapshot::RemoveOrphanLocks(shm_dir_);
  }
}

Status NodeSnapshots::Open() {
  shm_dir_ = snapshot::ShmDir(config_.getenv(envvar::kShmDir));
  auto lock = snapshot::HolderLock::Acquire(
      shm_dir_, config_.job_id, HostName(),
      fmt::format("efdl run, job {}, node {}", config_.job_id, config_.node_id));
  if (!lock.ok()) return lock.status();
  holder_lock_ = std::move(lock).value();
  const std::string job = snapshot::SafeName(config_.job_id);
  auto entries = snapshot::ScanArenaDir(shm_dir_, snapshot::HolderLockHeld);
  // Other jobs' arenas whose holder died: nobody restores from them on this host any more.
  auto removed = snapshot::RemoveArenas(shm_dir_, snapshot::PlanGc(entries, job),
                                        holder_lock_->holder());
  if (!removed.empty()) {
    EFDL_LOG_INFO("removed {} snapshot arena(s) of dead processes from {}: {}", removed.size(),
                  shm_dir_, fmt::join(removed, ", "));
  }
  snapshot::RemoveOrphanLocks(shm_dir_);
  // This job's arenas whose holder died (this node's predecessor on this host): adopt the
  // newest, so the workers restore from memory.
  snapshot::ApplyAdoption(
      shm_dir_, snapshot::PlanAdoption(entries, job, holder_lock_->holder(), shm_dir_),
      holder_lock_->holder());
  EFDL_LOG_DEBUG("snapshot arenas of this node: {}",
                 snapshot::ArenaPath(shm_dir_, config_.job_id, holder_lock_->holder(), "*"));
  if (!config_.persist) return Status::OK();
  auto persist = AgentPersisterOptionsFromEnvironment(
      config_.job_id, holder_lock_->holder(), config_.snapshot_dir, config_.job_secret,
      config_.getenv);
  if (!persist.ok()) return persist.status();
  // A node whose lease may have expired (frozen past the TTL, cut off from etcd) may already be
  // replaced by a newer round: what it was writing must not appear in storage.
  persist->before_publish = [&rdzv = rdzv_](const snapshot::Manifest& m) {
    return rdzv.MayPublish(m.wall_time)
               ? Status::OK()
               : Status::FailedPrecondition(
                     "it was committed before this node's etcd lease expired or may have (the "
                     "node was frozen or cut off from etcd); a newer round may run without it");
  };
  if (metrics::AgentMetrics* m = config_.metrics) {
    persist->after_write = [m](const Status& s, double seconds, const snapshot::Manifest* w) {
      if (s.ok() && w != nullptr) {
        m->ObservePersist(seconds, w->data_bytes, w->wall_time);
      } else {
        m->CountPersistFailure();
      }
    };
  }
  persister_ = std::make_unique<AgentPersister>(std::move(persist).value());
  return Status::OK();
}

void NodeSnapshots::SetRound(int rank_offset, int nproc) {
  if (persister_) {
    persister_->SetTargets(PersistTargetsFor(persister_->options(), rank_offset, nproc));
  }
}

void NodeSnapshots::PersistNewest(const std::string& why) {
  if (!persister_ || persister_->targets().empty()) return;
  Status s = persister_->Flush(std::chrono::minutes(10));
  if (!s.ok()) {
    EFDL_LOG_WARN("persisting the newest snapshot failed ({}); the previous one in storage is "
                  "kept: {}", why, s.message());
  }
}

void NodeSnapshots::ServeFlushes(ControlServer& control) {
  for (auto& request : control.TakeFlushRequests()) {
    if (!persister_) {
      // --launcher (its workers persist themselves) or the job is over: nothing to write here.
      control.AnswerFlush(request, Status::OK(), false);
      continue;
    }
    // The control server outlives persister_ (the Agent closes this first), so the answer is
    // safe.
    persister_->FlushAsync(request.scope, request.timeout,
                           [control = &control, request](const Status& s, bool persisted) {
                             control->AnswerFlush(request, s, persisted);
                           });
  }
}

void NodeSnapshots::StopWriting() {
  if (persister_) persister_->Clear();
}

void NodeSnapshots::Close() { persister_.reset(); }

void NodeSnapshots::RemoveJobArenas() {
  if (!holder_lock_) return;
  auto entries = snapshot::ScanArenaDir(shm_dir_, snapshot::HolderLockHeld);
  auto plan = snapshot::PlanJobRemoval(entries, snapshot::SafeName(config_.job_id),
                                       holder_lock_->holder());
  auto removed = snapshot::RemoveArenas(shm_dir_, plan, holder_lock_->holder());
  holder_lock_->RemoveFile();  // the agent exits next; its lock goes with it
  if (!removed.empty()) {
    EFDL_LOG_INFO("removed {} snapshot arena(s) of job '{}' from {}", removed.size(),
                  config_.job_id, shm_dir_);
  }
}

}  // namespace efdl::agent
