// PeerCopy: the copy of this node's per-rank arenas on its ring successor, and the copies of its
// ring predecessor's here (issue #35 part 2; docs/snapshots.md "Peer copy").
//
// Placement: the coordinator puts each member's successor in node-rank order (the last one's is
// the first) into its assignment (rdzv::PeerCopyRing, Assignment::peer_copy): replication factor
// 1, a ring. Only per-rank arenas (EFDL_SNAPSHOT_PER_RANK=1) are copied: a node copy is the
// same replicated state on every node. EFDL_PEER_COPY=0 turns it off.
//
// Sending (one thread): every poll it looks at the arenas "rank<N>" this node writes in the
// round (ranks rank_offset..rank_offset+nproc-1, under its holder); when one has a newer ready
// mark (snapshot/commit_marks.h: a commit whose seq is a multiple of the power of two of commits
// that spans EFDL_PERSIST_MIN_INTERVAL_MS, 1 s by default, so every node copies and stores the
// same commits), committed in this round, than the one last sent to the current target, it
// copies the slot into its buffer (kept between passes: the agent's heap holds the node's
// largest rank snapshot once) at memory speed, checks the arena's seqlock (Unchanged(slot,
// seq)) and sends it; a torn copy is discarded and tried again at the next poll. A pass that
// fails (the target dead, unreachable, refusing) is logged once (until its line changes) and
// retried after a back-off (PeerCopyOptions::retry_max: 0.1 s doubling up to 5 s), so a dead
// successor costs one connection attempt per back-off, not one per poll. It never pins (the
// node's persister pins with this process' pid, and one pid has one pin per slot), so it never
// holds a writer: commit() never waits for it.
//
// Receiving (one thread): it listens on the port it offers in its acks; a connection must answer
// an HMAC-SHA256 challenge keyed with the job's secret (and the receiver answers the sender's),
// else it is closed with one log line. Each snapshot received is written into the peer arena
// "peer.rank<N>" (snapshot/arena_dir.h) of 2 slots in this node's shm dir, a slot at a time
// with the arena's writer protocol: a transfer cut midway abandons its slot and leaves the
// previous complete copy. The receiver answers each snapshot's header before its bytes
// travel: a copy that does not fit in the shm dir (CheckArenaRoom) is skipped (not sent, nothing
// of it written) with one line per rank (until a copy of that rank is kept again); the job goes
// on, and that rank's shard is restored from storage if its host is lost. The data's
// checksum travels with it, is checked on arrival and stored in the slot, so a restore verifies
// it again.
//
// Which copies a node keeps: those of the ranks its current predecessor wrote at its newest
// transfer (each transfer names them); once a transfer of the round arrives, peer arenas of
// other ranks (an earlier predecessor's, which a recovery of that round has read by then: the
// predecessor commits only after its ranks' agreement) are removed. The job's end or a suspend
// removes them with the node's own arenas (same holder).
//
// Ownership: the Agent owns one PeerCopy; it owns both threads and its sockets, which the
// destructor stops and joins. SetRound and StopSending may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/thread_annotations.h"
#include "efdl/status.h"
#include "rendezvous/protocol.h"

namespace efdl::snapshot {
class SnapshotArena;
}  // namespace efdl::snapshot

namespace efdl::agent {

struct PeerCopyOptions {
  std::string job_id;
  std::string holder;                 // this agent's arena holder (snapshot/arena_dir.h)
  std::string shm_dir = "/dev/shm";   // EFDL_SHM_DIR
  std::string secret;                 // the job's secret (EFDL_JOB_SECRET); never logged
  std::string listen_addr;            // the advertise address ("": every interface)
  std::chrono::milliseconds min_interval{1000};   // EFDL_PERSIST_MIN_INTERVAL_MS
  std::chrono::milliseconds poll_interval{100};
  std::chrono::milliseconds io_timeout{10000};    // a stalled connection is dropped
  // A pass to the target that failed (cannot connect, refused, cut) makes the next try wait:
  // poll_interval after the first failure, doubling after each further one up to retry_max;
  // a pass that succeeds or a new target (SetRound) starts over.
  std::chrono::milliseconds retry_max{5000};
  int peer_slots = 2;
};

// Whether this agent keeps peer copies: per-rank snapshots on, EFDL_PEER_COPY not "0" (any
// other value or unset: on), and a job secret to authenticate with. `why_not` says why not.
bool PeerCopyWanted(const std::function<const char*(const char*)>& getenv, bool per_rank,
                    const std::string& secret, std::string* why_not);

class PeerCopy {
 public:
  // Binds the listening socket (a free port) and starts both threads.
  static Result<std::unique_ptr<PeerCopy>> Start(PeerCopyOptions options);
  ~PeerCopy();
  PeerCopy(const PeerCopy&) = delete;
  PeerCopy& operator=(const PeerCopy&) = delete;

  uint16_t port() const { return port_; }
  // The round's place: this node writes ranks rank_offset..rank_offset+nproc-1 and copies them
  // to `target` (port 0: to nobody).
  void SetRound(int64_t round, int rank_offset, int nproc, rdzv::PeerCopyTarget target);
  // Sends nothing more until the next SetRound (fenced, excluded).
  void StopSending();

  struct Counts {
    uint64_t sent = 0;       // snapshots sent and installed by the receiver
    uint64_t torn = 0;       // copies discarded because a commit took the slot meanwhile
    uint64_t received = 0;   // snapshots installed here
    uint64_t refused = 0;    // connections that failed authentication
    uint64_t skipped = 0;    // copies not kept here for want of room
    uint64_t failed = 0;     // passes to the target that failed (each followed by a back-off)
    uint64_t bytes_sent = 0;   // snapshot bytes (manifests and data) sent to targets
  };
  Counts counts() const;

 private:
  PeerCopy(PeerCopyOptions options, int listen_fd, uint16_t port);
  void SendLoop();
  void ReceiveLoop();
  void Serve(int fd);

  const PeerCopyOptions options_;
  const int listen_fd_;
  const uint16_t port_;
  int wake_[2] = {-1, -1};   // a pipe the destructor writes to end the receiver's poll()

  mutable Mutex mu_;
  std::condition_variable_any cv_;
  bool stop_ EFDL_GUARDED_BY(mu_) = false;
  int64_t round_ EFDL_GUARDED_BY(mu_) = 0;
  double round_start_ EFDL_GUARDED_BY(mu_) = 0;   // seconds since the epoch, at SetRound
  int rank_offset_ EFDL_GUARDED_BY(mu_) = 0;
  int nproc_ EFDL_GUARDED_BY(mu_) = 0;
  rdzv::PeerCopyTarget target_ EFDL_GUARDED_BY(mu_);
  Counts counts_ EFDL_GUARDED_BY(mu_);
  // The receiver thread's: the newest round sent to it, and the peer arenas it writes (by path).
  int64_t newest_round_ = 0;
  std::map<std::string, std::unique_ptr<snapshot::SnapshotArena>> peer_arenas_;
  std::set<std::string> skipping_;   // scopes whose copies were skipped for want of room
  std::atomic<int> serving_fd_{-1};   // the connection being served (shut down at stop)
  std::atomic<int> sending_fd_{-1};   // the connection being sent on (ditto)

  std::thread sender_;
  std::thread receiver_;
};

}  // namespace efdl::agent
