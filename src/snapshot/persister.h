// Persister: copies the newest snapshot of an arena to a SnapshotStore, off the training path;
// its thread takes the newest ready mark (commit_marks.h), so nodes store the same commits.
//
// Works on an arena path, not an object, so the same class runs on a background thread of the
// worker (no agent) or in the node's agent for its workers' arenas; it re-opens the arena when
// the writer replaced it (grown). The slot being written is pinned, so commits continue into the
// other slots meanwhile; with two slots a commit may take it (the arena never lets a commit write
// into the newest snapshot): the persister sees that between chunks and at the end of the data
// (a seqlock check), discards the temporary and goes on at once with the newest snapshot. After
// kHoldAfterPreemptions such preemptions in a row it pins with a hold, which a commit waits for
// at most kMaxHoldWait (arena.h), so persistence progresses whenever copying a snapshot to the
// file fits in a commit interval plus that bound. The slot is released as soon as the data is
// in the file, before the sync. Failures (a full disk) are logged once each, kept in
// last_status(), and retried on the next commit; the previous snapshot in storage stays.
//
// Thread-safety: all public methods are thread-safe. The destructor stops and joins the thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/thread_annotations.h"
#include "efdl/status.h"
#include "snapshot/arena.h"
#include "snapshot/commit_marks.h"
#include "snapshot/parallel.h"
#include "snapshot/store.h"

namespace efdl::snapshot {

struct PersisterOptions {
  std::string arena_path;
  std::string storage_dir;
  int keep = 2;
  Env* env = nullptr;
  // The thread writes only marks (commit_marks.h): about one commit per interval, the same
  // commits on every node (0: every commit). Flush and PersistNewestOnce take the newest.
  std::chrono::milliseconds min_interval{0};
  std::chrono::milliseconds poll_interval{500}; // also look without Notify (writer elsewhere)
  std::string hmac_key;                         // non-empty: files carry an HMAC (hmac.h)
  // Asked right before each file is published (SnapshotStore::Write); the agent refuses while
  // its etcd lease may have expired (a frozen or cut-off node must not publish a stale write).
  std::function<Status(const Manifest&)> before_publish;
  // Told after each write to storage (the agent's metrics): on the persister's thread, must not
  // block. `seconds` the write took, `bytes` its data, `m` what was written; a failed write gives
  // its status and no manifest.
  std::function<void(const Status& status, double seconds, const Manifest* m)> after_write;
};

// Preemptions in a row after which the persister pins with a hold (arena.h, Pin).
inline constexpr int kHoldAfterPreemptions = 2;

// 16 data members, on purpose (issue #31): besides its options, store, arena and thread, the
// persister is one mutex's state - what Loop's waits test (stop, notified, idle, retry now; the
// mark rule's measurements are the thread's own, a local of Loop), what PersistLocked decides a try from and counts (the
// persisted seq, the preemptions and those in a row, which turn on the hold), and the last
// status with the error last logged - read and written together under mu_ in one pass of the
// loop, so that splitting it would split that lock's invariants across objects.
class Persister {
 public:
  explicit Persister(PersisterOptions options);
  ~Persister();
  Persister(const Persister&) = delete;
  Persister& operator=(const Persister&) = delete;

  void Start();  // the background thread
  void Notify(); // a commit was published
  // Persists the newest ready snapshot if storage does not have it yet. Returns true when it wrote
  // one. Used by the thread, Flush, and callers without a thread (the agent on shutdown).
  Result<bool> PersistNewestOnce();
  // Waits until the newest snapshot committed before the call is in storage (or the timeout).
  Status Flush(std::chrono::milliseconds timeout);
  Status last_status() const;
  uint64_t persisted_seq() const;
  // Writes abandoned because a commit took the slot being written (since the start).
  uint64_t preemptions() const;

 private:
  void Loop();
  // `marks`: the thread's, which observes the newest seq and writes only the newest ready
  // mark; nullptr: the newest ready snapshot.
  Result<bool> PersistOnce(CommitMarks* marks);
  Result<bool> PersistLocked(CommitMarks* marks) EFDL_REQUIRES(persist_mu_);

  PersisterOptions options_;
  SnapshotStore store_;
  Mutex persist_mu_;                          // one persist at a time (thread or Flush)
  std::unique_ptr<SnapshotArena> arena_ EFDL_GUARDED_BY(persist_mu_);
  mutable Mutex mu_;                          // taken after persist_mu_, never before
  std::condition_variable_any cv_;
  bool stop_ EFDL_GUARDED_BY(mu_) = false;
  uint64_t notified_ EFDL_GUARDED_BY(mu_) = 0;
  bool idle_ EFDL_GUARDED_BY(mu_) = false;    // waiting for a commit
  uint64_t persisted_seq_ EFDL_GUARDED_BY(mu_) = 0;
  uint64_t preemptions_ EFDL_GUARDED_BY(mu_) = 0;
  int preempted_in_a_row_ EFDL_GUARDED_BY(mu_) = 0;
  bool retry_now_ EFDL_GUARDED_BY(mu_) = false;  // the last try was preempted: try again at once
  Status last_status_ EFDL_GUARDED_BY(mu_);
  std::string last_logged_error_ EFDL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace efdl::snapshot
