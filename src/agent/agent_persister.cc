#include "agent/agent_persister.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "common/env_names.h"
#include "common/log.h"
#include "snapshot/arena_dir.h"
#include "snapshot/env.h"
#include "snapshot/persist_settings.h"
#include "snapshot/persister.h"
#include "snapshot/scope.h"

namespace efdl::agent {

namespace {

std::string ArenaPath(const AgentPersisterOptions& o, const std::string& scope) {
  return snapshot::ArenaPath(o.shm_dir, o.job_id, o.holder, scope);
}

}  // namespace

Result<AgentPersisterOptions> AgentPersisterOptionsFromEnvironment(
    std::string job_id, std::string holder, std::string snapshot_dir, std::string job_secret,
    const std::function<const char*(const char*)>& getenv) {
  AgentPersisterOptions o;
  o.job_id = std::move(job_id);
  o.holder = std::move(holder);
  o.snapshot_dir = std::move(snapshot_dir);
  if (const char* shm = getenv(envvar::kShmDir); shm != nullptr && *shm != '\0') o.shm_dir = shm;
  auto settings = snapshot::PersistSettingsFromEnvironment(getenv, std::move(job_secret));
  if (!settings.ok()) return settings.status();
  o.per_rank = settings->per_rank;
  o.keep = settings->keep;
  o.min_interval = settings->min_interval;
  o.hmac_key = std::move(settings->hmac_key);
  return o;
}

std::vector<PersistTarget> PersistTargetsFor(const AgentPersisterOptions& o, int rank_offset,
                                             int nproc) {
  std::vector<PersistTarget> out;
  if (o.snapshot_dir.empty() || nproc <= 0) return out;
  // The arenas of this node's ranks whose snapshots go to storage (snapshot/scope.h: the node
  // copy of the node running global rank 0, or every rank's own), each to its store.
  for (int lr = 0; lr < nproc; ++lr) {
    const int rank = rank_offset + lr;
    const snapshot::SnapshotRole role = snapshot::RoleOf(o.per_rank, rank, lr);
    if (!role.stored) continue;
    out.push_back({ArenaPath(o, role.scope),
                   snapshot::StoreDir(o.snapshot_dir, o.job_id, o.per_rank, rank)});
  }
  return out;
}

AgentPersister::AgentPersister(AgentPersisterOptions options) : options_(std::move(options)) {}

AgentPersister::~AgentPersister() {
  std::deque<FlushJob> left;
  {
    MutexLock lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (flusher_.joinable()) flusher_.join();
  {
    MutexLock lock(mutex_);
    left.swap(jobs_);
  }
  for (auto& job : left) {
    job.done(Status::Unavailable("the node agent is stopping; it persists the newest snapshot "
                                 "itself before it exits"),
             false);
  }
}

std::shared_ptr<snapshot::Persister> AgentPersister::MakePersister(
    const PersistTarget& target) const {
  snapshot::PersisterOptions p;
  p.arena_path = target.arena_path;
  p.storage_dir = target.storage_dir;
  p.keep = options_.keep;
  p.env = snapshot::Env::Posix();
  p.min_interval = options_.min_interval;
  p.poll_interval = options_.poll_interval;
  p.hmac_key = options_.hmac_key;
  p.before_publish = options_.before_publish;
  p.after_write = options_.after_write;
  auto persister = std::make_shared<snapshot::Persister>(std::move(p));
  persister->Start();
  return persister;
}

void AgentPersister::SetTargets(std::vector<PersistTarget> targets) {
  std::vector<std::shared_ptr<snapshot::Persister>> next(targets.size());
  std::vector<std::shared_ptr<snapshot::Persister>> dropped;
  for (size_t i = 0; i < targets_.size(); ++i) {
    auto kept = std::find(targets.begin(), targets.end(), targets_[i]);
    if (kept != targets.end()) {
      next[static_cast<size_t>(kept - targets.begin())] = persisters_[i];
      continue;
    }
    // No longer this node's to write: finish the round that ended first.
    Status s = persisters_[i]->Flush(std::chrono::minutes(10));
    if (!s.ok()) {
      EFDL_LOG_WARN("persisting the newest snapshot of {} failed: {}", targets_[i].arena_path,
                    s.message());
    }
    dropped.push_back(persisters_[i]);
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!next[i]) {
      next[i] = MakePersister(targets[i]);
      EFDL_LOG_DEBUG("persisting snapshots of {} to {}", targets[i].arena_path,
                     targets[i].storage_dir);
    }
  }
  {
    MutexLock lock(mutex_);
    targets_ = std::move(targets);
    persisters_ = std::move(next);
  }
  // `dropped` stops its threads here, outside the lock (or on the flusher, if it holds one).
}

void AgentPersister::Clear() {
  std::vector<std::shared_ptr<snapshot::Persister>> dropped;
  MutexLock lock(mutex_);
  dropped.swap(persisters_);
  targets_.clear();
}

Status AgentPersister::Flush(std::chrono::milliseconds timeout) {
  Status first;
  for (size_t i = 0; i < persisters_.size(); ++i) {
    Status s = persisters_[i]->Flush(timeout);
    if (!s.ok() && first.ok()) first = s.WithContext(targets_[i].arena_path);
  }
  return first;
}

void AgentPersister::FlushAsync(const std::string& scope, std::chrono::milliseconds timeout,
                                FlushDone done) {
  {
    MutexLock lock(mutex_);
    jobs_.push_back({ArenaPath(options_, scope), timeout, std::move(done)});
    if (!flusher_.joinable()) flusher_ = std::thread([this] { FlusherLoop(); });
  }
  cv_.notify_all();
}

void AgentPersister::FlusherLoop() {
  MutexLock lock(mutex_);
  while (true) {
    cv_.wait(lock, [&]() EFDL_REQUIRES(mutex_) { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    FlushJob job = std::move(jobs_.front());
    jobs_.pop_front();
    std::shared_ptr<snapshot::Persister> persister;
    for (size_t i = 0; i < targets_.size(); ++i) {
      if (targets_[i].arena_path == job.arena_path) persister = persisters_[i];
    }
    lock.unlock();
    if (persister == nullptr) {
      job.done(Status::OK(), false);
    } else {
      Status s = persister->Flush(job.timeout);
      job.done(s.ok() ? s : s.WithContext("persisting " + job.arena_path), true);
    }
    persister.reset();  // may stop a persister a round change dropped meanwhile: not locked
    lock.lock();
  }
}

}  // namespace efdl::agent
