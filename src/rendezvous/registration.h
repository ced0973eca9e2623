// One node's registration in a job (protocol.h): a lease kept alive, the node key under it, and
// the watches through which the node follows the job - the round record, its own assign key,
// the coordinator's node key (kept open across rounds), and the give-up records. Fencing, suspension
// and leaving each end it in one call.
//
// Threading: the driver thread of EtcdRendezvous makes every call (Join and Leave before and
// after that thread), except MayPublish, which the agent's persister calls from its own thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "efdl/status.h"
#include "rendezvous/node_rules.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

// A registration's lease keeper and what may be published under it: the one part of a
// Registration that another thread reads (the agent's persister, through MayPublish).
class KeptLease {
 public:
  // Replaces the keeper (nullptr: none; the old one is destroyed outside the lock). `fenced`:
  // the lease was lost, and nothing committed before now is published again.
  void Set(std::unique_ptr<etcd::LeaseKeeper> keeper, bool fenced);
  bool MayPublish(double committed_at) const;

 private:
  mutable Mutex mu_;
  std::unique_ptr<etcd::LeaseKeeper> keeper_ EFDL_GUARDED_BY(mu_);
  bool fenced_ EFDL_GUARDED_BY(mu_) = false;          // until the next Set
  double fenced_at_wall_ EFDL_GUARDED_BY(mu_) = 0;    // when last fenced (epoch s)
};

// 13 members: the node's identity and callbacks (const), the lease with its generation and
// keeper (KeptLease), the four watches it owns and the coordinator it follows: one room, the
// node's presence in etcd, ended in one call.
class Registration {
 public:
  enum class Stream { kRound, kAssign, kGaveUp };
  struct Callbacks {
    // The callback of a watch of `stream`, tagged with the registration's generation.
    std::function<etcd::WatchCallback(Stream, uint64_t generation)> watch;
    // The watch of `coordinator`'s node key delivered its deletion at `revision` (INT64_MAX:
    // the watch broke); the driver passes it to CoordinatorDeleted.
    std::function<void(uint64_t generation, const std::string& coordinator, int64_t revision)>
        coordinator_deleted;
    // The keeper gave up on `lease` (expired or revoked).
    std::function<void(int64_t lease)> lease_lost;
  };

  Registration(etcd::Client& client, const JobKeys& keys, std::string job_id, std::string node_id,
               Callbacks callbacks)
      : client_(client), keys_(keys), job_id_(std::move(job_id)), node_id_(std::move(node_id)),
        cb_(std::move(callbacks)) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  struct Joined {
    int64_t revision = 0;          // of the registration
    RoundRecord round;             // the job's round record, read in the same request
    int64_t round_revision = 0;    // its mod revision (0 when this node created it just now)
  };
  // Grants a lease (the TTL rounded up to whole seconds) and keeps it alive, puts the node key
  // under it and reads the round record in the same request (the job's first node creates it
  // from `fresh`), then watches the round and this node's assignment from there, and the
  // give-up records from the first registration on. A node that names its program (me.program)
  // registers only if it is the job's (the P program key, compared in the same request; see
  // RegisterNode). AlreadyExists: an agent whose lease is kept alive holds the node id.
  // FailedPrecondition: the job is suspended, or runs another program. On an error nothing of
  // the attempt stays in etcd and an earlier registration is untouched.
  Result<Joined> Open(const NodeRecord& me, std::chrono::milliseconds ttl,
                      const RoundRecord& fresh);

  struct Reread {
    std::optional<etcd::KeyValue> round, assign;
  };
  // After a broken watch: a new generation re-reads the round record and the assignment and
  // watches both again from there.
  Result<Reread> Rewatch();

  // Follows the node key of `coordinator` ("" follows none) after `after_revision`. The watch
  // of that key stays open when the node stops following and is used again when it follows the
  // same coordinator from a revision the watch covers (node_rules.h FollowWatch): a member that
  // re-rounds costs no watch request. after_revision 0 (a deputy): reads the key first and
  // follows from its revision. Returns true when the followed coordinator is gone already (its
  // deletion read or delivered); else a later deletion is reported through
  // Callbacks::coordinator_deleted.
  bool FollowCoordinator(const std::string& coordinator, int64_t after_revision = 0);
  const std::string& followed() const { return followed_; }
  // The follow watch delivered a deletion of `coordinator`'s key at `revision` (INT64_MAX: the
  // watch broke, and is replaced the next time the node follows): whether the coordinator the
  // node follows is gone now (node_rules.h FollowedIsGone).
  bool CoordinatorDeleted(const std::string& coordinator, int64_t revision);

  // Stops following the round, the assignment and the coordinator (the give-up records go on).
  void StopWatching();
  // The lease was lost: MayPublish answers false from now until the next Open, the watches stop,
  // and a new generation makes queued updates of this registration stale.
  void Fence();
  // Revokes the lease, taking the node key and the ack with it.
  void Release();

  int64_t lease() const { return lease_; }
  uint64_t generation() const { return generation_; }
  // Whether a snapshot committed at `committed_at` (epoch seconds) may still be published: not
  // while fenced, nor one committed before the last fence, nor after the lease's local expiry.
  bool MayPublish(double committed_at) const { return kept_.MayPublish(committed_at); }

 private:
  // The registration txn under `lease`: puts the node key unless a live agent holds it and reads
  // the round record. With a program named, the txn also compares P program with it; when no
  // such key exists (the job's first node, or the node that wrote it is gone) the live nodes'
  // records are checked (CheckLiveNodesProgram) and the txn writes the key under `lease`.
  // Not succeeded: the node key is taken. FailedPrecondition: another program.
  Result<etcd::TxnResult> RegisterNode(const NodeRecord& me, int64_t lease);
  // Compares `program` with a live node's record: the coordinator's named in the round record
  // (two point reads), else one of the first two node records (a range with a limit of 2).
  Status CheckLiveNodesProgram(const std::string& program);
  Status OtherProgram(const std::string& runs, const std::string& node,
                      const std::string& program) const;

  etcd::Client& client_;
  const JobKeys& keys_;
  const std::string job_id_;
  const std::string node_id_;
  const Callbacks cb_;

  uint64_t generation_ = 0;             // bumped at each Open, Rewatch and Fence
  int64_t lease_ = 0;
  KeptLease kept_;                      // fenced until the next Open
  std::unique_ptr<etcd::Watch> round_watch_, assign_watch_, coordinator_watch_;
  std::unique_ptr<etcd::Watch> gaveup_watch_;   // from the first registration on
  FollowWatch follow_watch_;            // what coordinator_watch_ watches and delivered
  std::string followed_;                // "" follows none (the watch may stay open)
  int64_t follow_after_ = 0;            // followed_ counts deletions after this revision
};

}  // namespace efdl::rdzv
