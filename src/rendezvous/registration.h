// One node's registration in a job (protocol.h): a lease kept alive, the node key under it, and
// the watches through which the node follows the job - the round record, its own assign key,
// the coordinator's node key while it is a deputy, and the give-up records. Fencing, suspension
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
    // The coordinator this node follows as a deputy is gone (or its watch broke).
    std::function<void(uint64_t generation, const std::string& coordinator)> coordinator_gone;
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
  // give-up records from the first registration on. AlreadyExists: an agent whose lease is kept
  // alive holds the node id. FailedPrecondition: the job is suspended. On an error nothing of
  // the attempt stays in etcd and an earlier registration is untouched.
  Result<Joined> Open(const NodeRecord& me, std::chrono::milliseconds ttl,
                      const RoundRecord& fresh);

  struct Reread {
    std::optional<etcd::KeyValue> round, assign;
  };
  // After a broken watch: a new generation re-reads the round record and the assignment and
  // watches both again from there.
  Result<Reread> Rewatch();

  // Follows the node key of `coordinator` ("" follows none) and reports it gone through
  // Callbacks::coordinator_gone. after_revision 0: reads the key first and returns true when it
  // is gone already (nothing is reported then); else watches for its deletion after that
  // revision without a read (returns false), so that a crowd of followers costs no request.
  bool FollowCoordinator(const std::string& coordinator, int64_t after_revision = 0);
  const std::string& followed() const { return followed_; }

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
  std::string followed_;
};

}  // namespace efdl::rdzv
