#include "agent/agent_persister.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>

#include <fmt/format.h>

#include "common/log.h"
#include "snapshot/arena_dir.h"
#include "snapshot/env.h"
#include "snapshot/persister.h"

namespace efdl::agent {

namespace {

std::string Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// As state.py's _env_int: unset or blank is the default, anything else must be an integer.
Result<int64_t> EnvInt(const std::function<const char*(const char*)>& getenv, const char* name,
                       int64_t fallback) {
  const char* raw = getenv(name);
  std::string value = Trim(raw != nullptr ? raw : "");
  if (value.empty()) return fallback;
  std::string_view digits = value;
  if (digits.front() == '+') digits.remove_prefix(1);
  int64_t out = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  if (ec != std::errc() || end != digits.data() + digits.size()) {
    return Status::InvalidArgument(
        fmt::format("environment variable {}='{}' is not an integer; set it to a whole number "
                    "or unset it", name, value));
  }
  return out;
}

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
  if (const char* shm = getenv("EFDL_SHM_DIR"); shm != nullptr && *shm != '\0') o.shm_dir = shm;
  auto per_rank = EnvInt(getenv, "EFDL_SNAPSHOT_PER_RANK", 0);
  if (!per_rank.ok()) return per_rank.status();
  o.per_rank = *per_rank != 0;
  auto keep = EnvInt(getenv, "EFDL_SNAPSHOT_KEEP", 2);
  if (!keep.ok()) return keep.status();
  if (*keep < 1) {
    return Status::InvalidArgument(fmt::format(
        "EFDL_SNAPSHOT_KEEP={} keeps no snapshot; set it to 1 or more", *keep));
  }
  o.keep = static_cast<int>(std::min<int64_t>(*keep, 1 << 20));
  auto interval = EnvInt(getenv, "EFDL_PERSIST_MIN_INTERVAL_MS", 1000);
  if (!interval.ok()) return interval.status();
  o.min_interval = std::chrono::milliseconds(std::max<int64_t>(*interval, 0));
  const char* hmac = getenv("EFDL_SNAPSHOT_HMAC");
  std::string flag = Trim(hmac != nullptr ? hmac : "");
  std::transform(flag.begin(), flag.end(), flag.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (flag == "1" || flag == "true" || flag == "yes" || flag == "on") {
    if (job_secret.empty()) {
      return Status::InvalidArgument(
          "EFDL_SNAPSHOT_HMAC=1 needs the job's secret, which this agent was not given (efdl "
          "run keeps it in etcd): run the agent with `efdl run`, or unset EFDL_SNAPSHOT_HMAC");
    }
    o.hmac_key = std::move(job_secret);
  }
  return o;
}

std::vector<PersistTarget> PersistTargetsFor(const AgentPersisterOptions& o, int rank_offset,
                                             int nproc) {
  std::vector<PersistTarget> out;
  if (o.snapshot_dir.empty() || nproc <= 0) return out;
  const std::filesystem::path job_dir = std::filesystem::path(o.snapshot_dir) / o.job_id;
  if (!o.per_rank) {
    // Local rank 0 writes the node copy on every node; storage gets the rank-0 node's.
    if (rank_offset == 0) out.push_back({ArenaPath(o, "node"), job_dir.string()});
    return out;
  }
  for (int lr = 0; lr < nproc; ++lr) {
    const int rank = rank_offset + lr;
    out.push_back({ArenaPath(o, fmt::format("rank{}", rank)),
                   (job_dir / fmt::format("rank-{}", rank)).string()});
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
