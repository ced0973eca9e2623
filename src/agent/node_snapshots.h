// NodeSnapshots: this node's snapshots between its workers' shared memory and storage
// (docs/snapshots.md; issue #31 step 1). It holds the host's holder lock of the job's arenas
// (snapshot/arena_dir.h: taken first, it adopts a dead predecessor's arenas and removes other
// jobs' dead ones), runs the AgentPersister that writes the round's arenas to storage and
// answers the workers' flush requests, removes the job's arenas when the job completes or is
// suspended, and reads the newest snapshot in storage (what a suspend reports).
//
// It decides nothing about rounds: the Agent tells it the round's place (SetRound), when to
// write the newest snapshot now (PersistNewest, before a stop or the job's end), when storage is
// no longer this node's to write (StopWriting: fenced, excluded, evicted) and when nothing more
// is to be persisted (Close).
//
// Single-threaded: called from the Agent's loop (the persister's threads are its own).
#pragma once

#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "agent/agent_persister.h"
#include "agent/control_server.h"
#include "efdl/status.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/rendezvous.h"
#include "snapshot/arena_dir.h"

namespace efdl::agent {

// The newest snapshot of job `job_id` in `snapshot_dir` (python/efdl/state.py writes them to
// <snapshot dir>/<job>/, or rank-<N>/ below it for per-rank snapshots, where the job's point is
// the oldest rank's newest), read from the file's checked header and manifest: its sequence
// number, step and "epoch" keyword argument; nullopt when there is none (or the directory is not
// visible from this node).
std::optional<rdzv::PersistedPoint> NewestStoredPoint(const std::string& snapshot_dir,
                                                      const std::string& job_id);

class NodeSnapshots {
 public:
  // What it needs of the job and the node (from AgentOptions).
  struct Config {
    std::string job_id;
    std::string node_id;
    std::string snapshot_dir;   // the workers' EFDL_SNAPSHOT_DIR
    std::string job_secret;     // the HMAC key with EFDL_SNAPSHOT_HMAC=1; never logged
    // false (--launcher): the workers persist themselves; only the holder lock is taken.
    bool persist = true;
    metrics::AgentMetrics* metrics = nullptr;   // null: none
    // EFDL_SHM_DIR and the persistence settings are read through it (tests inject them).
    std::function<const char*(const char*)> getenv = [](const char* name) -> const char* {
      return std::getenv(name);
    };
  };

  // Of `rendezvous` it calls only MayPublish (a snapshot committed after this node's lease may
  // have expired is not published); it must outlive this object.
  NodeSnapshots(Config config, rdzv::Rendezvous& rendezvous)
      : config_(std::move(config)), rdzv_(rendezvous) {}
  // Stops the persister; releases the holder lock (its file stays only while arenas of this
  // holder do, for the next agent to adopt).
  ~NodeSnapshots();
  NodeSnapshots(const NodeSnapshots&) = delete;
  NodeSnapshots& operator=(const NodeSnapshots&) = delete;

  // Takes the holder lock (adoption, gc) and, with `persist`, starts the persister. The error
  // (one line, the caller logs it) when no holder can be taken or a setting is wrong.
  Status Open();
  // This agent's arena holder (after Open): the workers' EFDL_ARENA_HOLDER.
  const std::string& holder() const { return holder_lock_->holder(); }
  // The round's place: this node runs global ranks rank_offset..rank_offset+nproc-1 (nproc 0:
  // a standby), which decides the arenas it writes to storage.
  void SetRound(int rank_offset, int nproc);
  // Writes the newest snapshot in this node's arenas to storage now, before `why` (a stop, the
  // job's end) is acted on; a failure is logged, the previous one is kept.
  void PersistNewest(const std::string& why);
  // Hands the workers' flush requests (State.flush()) to the persister, which answers them on
  // `control` (it must outlive this object's persister: Close first).
  void ServeFlushes(ControlServer& control);
  // No longer a member of the round (fenced, excluded, evicted): storage is not this node's to
  // write until SetRound.
  void StopWriting();
  // Nothing more is persisted (the job completed or is suspended): the persister stops.
  void Close();
  // The job completed or was suspended: removes its arenas on this host (own and dead ones) and
  // the holder's lock file.
  void RemoveJobArenas();
  // The newest snapshot of the job in storage (NewestStoredPoint).
  std::optional<rdzv::PersistedPoint> NewestStored() const {
    return NewestStoredPoint(config_.snapshot_dir, config_.job_id);
  }

 private:
  const Config config_;
  rdzv::Rendezvous& rdzv_;
  std::string shm_dir_;   // EFDL_SHM_DIR
  // Held for the agent's lifetime: the arenas named after it are this agent's (liveness for gc).
  std::unique_ptr<snapshot::HolderLock> holder_lock_;
  // The workers' snapshots go to storage from here (null with persist false, after Close).
  std::unique_ptr<AgentPersister> persister_;
};

}  // namespace efdl::agent
