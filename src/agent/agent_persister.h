// AgentPersister: the node agent persists its workers' snapshots (docs/snapshots.md).
//
// Under `efdl run` the workers only commit into their shared-memory arenas (they get
// EFDL_AGENT_PERSISTS=1 and start no persister thread); the agent runs one snapshot::Persister per
// arena this node must write to storage in the current round:
// - node copies (default): the arena "node" of the node hosting global rank 0, written to
//   <snapshot dir>/<job>/ — only that node writes, so a shared mount has one writer;
// - per-rank states (EFDL_SNAPSHOT_PER_RANK=1): every local rank's arena "rank<R>", written to
//   <snapshot dir>/<job>/rank-<R>/.
// Arena paths come from snapshot/arena_dir.h (the one owner of the naming, which state.py calls
// too): <shm dir>/efdl-<job>-<holder>-<scope>.arena.
//
// New commits are found by polling the arena's header (a stat and one header page every
// poll_interval): that also covers a worker that died right after its commit, a worker that never
// connected to the control socket, and the time between rounds, and costs nothing measurable.
// Storage gets the newest ready mark (snapshot/commit_marks.h: a commit whose seq is a multiple
// of the power of two of commits that spans min_interval, so the nodes' per-rank stores hold the
// same commits); the commits in between are skipped, and the slot being written is pinned, so
// commit() never waits.
//
// A worker's State.flush() reaches FlushAsync (through the control socket and the agent's loop):
// one "flusher" thread, started at the first request, waits for the matching Persister's Flush so
// that neither the loop nor the control socket's thread blocks on storage.
//
// Ownership and thread-safety: the agent owns one AgentPersister; each Persister owns its thread,
// which the destructor (and SetTargets, for persisters no longer wanted) stops and joins; the
// flusher thread is joined by the destructor (requests still queued are answered Unavailable).
// Methods are called from the agent's loop thread only; the flusher reads the targets under
// mutex_ and holds a reference to the Persister it waits on, so a round change meanwhile is safe
// (the flush in flight finishes, for a snapshot this node committed while it was the writer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "efdl/snapshot.h"
#include "efdl/status.h"

namespace efdl::snapshot {
class Persister;
}  // namespace efdl::snapshot

namespace efdl::agent {

struct AgentPersisterOptions {
  std::string job_id;
  std::string holder;                 // this agent's arena holder (snapshot/arena_dir.h)
  std::string shm_dir = "/dev/shm";   // EFDL_SHM_DIR
  std::string snapshot_dir;           // the workers' EFDL_SNAPSHOT_DIR (absolute); empty: off
  bool per_rank = false;              // EFDL_SNAPSHOT_PER_RANK
  int keep = 2;                       // EFDL_SNAPSHOT_KEEP
  std::chrono::milliseconds min_interval{1000};  // EFDL_PERSIST_MIN_INTERVAL_MS
  std::chrono::milliseconds poll_interval{150};
  std::string hmac_key;               // the job's secret when EFDL_SNAPSHOT_HMAC=1, else empty
  std::function<Status(const snapshot::Manifest&)> before_publish;   // PersisterOptions
  std::function<void(const Status&, double, const snapshot::Manifest*)> after_write;   // ditto
};

// The options from the environment: EFDL_SHM_DIR, and the persistence settings through
// snapshot::PersistSettingsFromEnvironment, which State reads through too (the workers inherit
// the agent's environment, so both sides see the same values and refuse the same ones).
// `getenv` is injectable for tests. InvalidArgument with one line naming the variable.
Result<AgentPersisterOptions> AgentPersisterOptionsFromEnvironment(
    std::string job_id, std::string holder, std::string snapshot_dir, std::string job_secret,
    const std::function<const char*(const char*)>& getenv);

// One arena and the storage directory it goes to.
struct PersistTarget {
  std::string arena_path;
  std::string storage_dir;
  bool operator==(const PersistTarget&) const = default;
};

// What this node persists in a round where it runs global ranks rank_offset..rank_offset+nproc-1
// (nproc 0: standby, nothing).
std::vector<PersistTarget> PersistTargetsFor(const AgentPersisterOptions& options,
                                             int rank_offset, int nproc);

class AgentPersister {
 public:
  explicit AgentPersister(AgentPersisterOptions options);
  ~AgentPersister();  // stops and joins the threads; does not flush (callers Flush first)
  AgentPersister(const AgentPersister&) = delete;
  AgentPersister& operator=(const AgentPersister&) = delete;

  const AgentPersisterOptions& options() const { return options_; }

  // Persists `targets` from now on. A target kept from before keeps its thread; one dropped is
  // flushed first (its arena's newest snapshot belongs to the round that just ended, which this
  // node was the writer of), then stopped.
  void SetTargets(std::vector<PersistTarget> targets);
  // Stops persisting without writing anything more (a fenced node must not write storage).
  void Clear();
  // Writes the newest ready snapshot of every target's arena to storage unless it is there
  // already; returns the first failure (each is also logged once by its Persister).
  Status Flush(std::chrono::milliseconds timeout);
  const std::vector<PersistTarget>& targets() const { return targets_; }

  // Persists the newest snapshot of the arena of `scope` ("node", "rank<N>") on the flusher
  // thread and then calls done(status, persisted) there. persisted is false (with OK) when this
  // node does not write that arena to storage in this round (e.g. the node copy of a node that
  // does not host rank 0: the rank-0 node stores the same step).
  using FlushDone = std::function<void(const Status&, bool persisted)>;
  void FlushAsync(const std::string& scope, std::chrono::milliseconds timeout, FlushDone done);

 private:
  struct FlushJob {
    std::string arena_path;
    std::chrono::milliseconds timeout;
    FlushDone done;
  };
  std::shared_ptr<snapshot::Persister> MakePersister(const PersistTarget& target) const;
  void FlusherLoop();

  const AgentPersisterOptions options_;
  std::vector<PersistTarget> targets_;  // written under mutex_ (read by the flusher)
  std::vector<std::shared_ptr<snapshot::Persister>> persisters_;  // parallel to targets_, ditto
  Mutex mutex_;
  std::condition_variable_any cv_;
  std::deque<FlushJob> jobs_ EFDL_GUARDED_BY(mutex_);
  bool stop_ EFDL_GUARDED_BY(mutex_) = false;
  std::thread flusher_;           // started by the first FlushAsync
};

}  // namespace efdl::agent
