// The contract between the node agent and the masterless rendezvous (owner: src/rendezvous).
//
// One Rendezvous per agent. It registers the node in etcd under the job's prefix, takes part in
// forming rounds, and tells the agent what to do through events. It never touches processes;
// the agent never touches etcd keys of the job directly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/job_spec.h"
#include "efdl/status.h"
#include "rendezvous/ledger.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

// The job's identity (common/job_spec.h) plus the rendezvous's timing.
struct RendezvousOptions : JobSpec {
  std::chrono::milliseconds ttl{std::chrono::seconds(10)};
  std::chrono::milliseconds last_call{std::chrono::seconds(3)};
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};
  // What this node runs ("train.py", a module name): the nodes of a job must run the same; a
  // node whose program differs from a registered node's is refused at Join. "" checks nothing.
  std::string program;
  // The agent's Prometheus endpoint (HOST:PORT, `efdl run --metrics-port`), announced in the
  // node's record for `efdl status`; "" none.
  std::string metrics_addr;
  // Added by the rendezvous owner (protocol tuning; defaults suit real jobs and tests):
  // after a proposal, nodes that sent no ack while no other ack came for this long are left out
  // of the round (a crashed node whose lease is still alive must not hold the job up).
  std::chrono::milliseconds liveness_window{400};
  // Deputy j of the coordinator waits j x takeover_step before replacing a vanished coordinator.
  std::chrono::milliseconds takeover_step{250};
  // Optional: called on an internal thread right after an event was queued (must not block);
  // lets one thread serve many Rendezvous objects (the simulator) instead of one per WaitEvent.
  std::function<void()> on_event;
};

// Where this node stands in a formed round: the round's place as one typed value. 17 fields,
// flat on purpose (issue #31): each is one thing the workers of the round are told, which
// WorkerEnvironment (src/agent/worker_env.cc) turns into their environment field by field.
struct Assignment {
  int64_t round = 0;
  bool standby = false;                // registered but not taking part (job at MAX)
  int node_rank = 0;                   // GROUP_RANK / NODE_RANK
  int nnodes = 0;                      // nodes in the round
  int rank_offset = 0;                 // global rank of this node's local rank 0
  int nproc = 0;                       // this node's workers
  int world_size = 0;                  // sum of nproc over the round
  std::string master_addr;             // rank-0 node's advertise address
  uint16_t master_port = 0;            // chosen fresh by the rank-0 node for this round
  // master_port is the rank-0 node's agent store (src/agent/agent_store.h), a TCPStore server
  // that outlives the round: every worker is a client of it (TORCHELASTIC_USE_AGENT_STORE).
  bool agent_store = false;
  // Horovod (docs/horovod.md). The rank-0 node's agent serves the round's Gloo rendezvous at
  // master_addr:horovod_port (0: not offered).
  uint16_t horovod_port = 0;
  // Per local rank: Horovod's cross rank and cross size. Empty when every node of the round
  // runs the same number of processes: then they are node_rank and nnodes.
  std::vector<int> cross_rank{};
  std::vector<int> cross_size{};
  // The rank-0 node only: every member's (node id, nproc) in rank order, for the rendezvous
  // server's scope sizes. Other nodes never receive this O(N) list.
  std::vector<std::pair<std::string, int>> horovod_hosts{};
  std::vector<std::string> horovod_clients{};   // the members' addresses (rank-0 node only)
  // Issue #32: this node's workers all exited 0 in its previous round before the job was
  // complete, and that broke their peers' collectives: the node counts it as its own failure.
  bool early_exit{};
  // Issue #35 part 2: where this node's agent copies its per-rank arenas (its ring successor in
  // this round; port 0: nowhere). src/agent/peer_copy.h.
  PeerCopyTarget peer_copy{};
};

// The newest snapshot a node found persisted (ReportSuspended): its commit sequence number
// (0: unknown), the caller's step and, when the snapshot has one, its "epoch" keyword argument.
struct PersistedPoint {
  uint64_t seq = 0;
  int64_t step = 0;
  std::optional<int64_t> epoch;
};

struct Event {
  enum class Type {
    kRoundStarted,   // start workers with `assignment`
    kRoundClosing,   // stop workers of `round` (membership changed or a peer failed);
                     // `graceful` = snapshot first (scale out, graceful scale in, suspend)
    kJobComplete,    // every worker of a round exited 0: exit 0
    kFenced,         // this node lost its lease: stop workers now, never rejoin `round`
    kFailed,         // unrecoverable (below MIN past join timeout, ...): `message` says why
    kSuspended,      // `efdl suspend`: stop workers gracefully (snapshot first), then call
                     // ReportSuspended() and Leave(); no more events follow
    kPeerGaveUp,     // another node left the job for good after its workers kept failing;
                     // `message` says which and why (informational)
  };
  Type type = Type::kRoundStarted;
  int64_t round = 0;
  bool graceful = false;
  Assignment assignment;
  std::string message;
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Registers the node (lease + key) and starts following the job. Fails with a clear message
  // when etcd is unreachable, the ids are invalid or the node id is taken. A job that is already
  // complete is not an error (issue 3: late agents exit 0): the first event is kJobComplete.
  virtual Status Join() = 0;
  // The next event, or nullopt after `timeout`.
  virtual std::optional<Event> WaitEvent(std::chrono::milliseconds timeout) = 0;
  // This node's workers of `round` failed (a worker exited non-zero); the round must be redone.
  virtual void ReportWorkerFailure(int64_t round, const std::string& detail) = 0;
  // This node's workers of `round` failed because a collective lost its peer (`cause`: which
  // error said so): the cause is on another node. The round is redone as for
  // ReportWorkerFailure, but its reason does not call this node's workers failed, and the
  // coordinator that forms the next round names the cause (coordination.h NameCause).
  virtual void ReportLostPeer(int64_t round, const std::string& detail, const std::string& cause) {
    (void)cause;
    ReportWorkerFailure(round, detail);
  }
  // All this node's workers of `round` exited 0.
  virtual void ReportWorkersSucceeded(int64_t round) = 0;
  // The same, naming the ranks ("rank 3", "ranks 2, 3"): the coordinator names them if the
  // exit turns out to have been early (the job not complete, peers' collectives lost them).
  virtual void ReportWorkersExited0(int64_t round, const std::string& ranks) {
    (void)ranks;
    ReportWorkersSucceeded(round);
  }
  // Every worker of this node said that its program returned in `round` (in-process; they may
  // still be tearing down): the outcome the next ack carries is "exited 0" (`ranks` as above),
  // so that a coordinator naming a round's cause sees it before the exits are reaped. Not a
  // completion: ReportWorkersExited0 still follows once they exited.
  virtual void NoteWorkersReturned(int64_t round, const std::string& ranks) {
    (void)round;
    (void)ranks;
  }
  // Leaves the job at once: revokes the lease so the others re-round without waiting.
  virtual void Leave() = 0;
  // Whether a snapshot this node committed at `committed_at` (wall seconds since the epoch) may
  // still be published to storage: false while the node's lease may have expired at etcd (its
  // local expiry passed without a renewal: a freeze, an outage) or it is fenced, and - once it
  // registered again - for anything committed before it was fenced: a newer round may have run
  // without it meanwhile. Thread-safe (the agent's persister threads ask). Doubles need not
  // override it.
  virtual bool MayPublish(double committed_at) const {
    (void)committed_at;
    return true;
  }
  // From the next ack on, offers `port` as this node's master port: its agent store, which lives
  // as long as the agent (0: none; offer a free port per round, which rank 0's worker binds).
  // Thread-safe. Doubles need not override it.
  virtual void OfferAgentStore(uint16_t port) { (void)port; }
  // From the next ack on, offers `port` as this node's peer-copy port (src/agent/peer_copy.h;
  // 0: none). Thread-safe. Doubles need not override it.
  virtual void OfferPeerCopy(uint16_t port) { (void)port; }
  // From the next ack on, tells `efdl status` that this node runs without pre-started workers
  // and why (one line; src/agent/spare_pool.h). Thread-safe. Doubles need not override it.
  virtual void NoteNoPrestart(const std::string& why) { (void)why; }
  // From the next ack on, `efdl status` shows `restarts` as this node's RESTARTS: the failures
  // its agent counted against --max-restarts (a collateral failure - a peer's crash, hang or
  // bug broke this node's collectives - is reported but not counted). Until the first call,
  // every reported failure counts. Thread-safe. Doubles need not override it.
  virtual void ReportRestarts(int restarts) { (void)restarts; }
  // The goodput ledger (ledger.h): this node's part of a round, and its end (leaving the job).
  // Blocking (an etcd write or two); a failure is the caller's to log. Doubles need not
  // override them.
  virtual Status RecordLedger(const LedgerPart& part) {
    (void)part;
    return Status::OK();
  }
  virtual Status RecordLedgerEnd(const LedgerEnd& end) {
    (void)end;
    return Status::OK();
  }
  // The job's ledger as `efdl events` reads it (one etcd range; blocking). Doubles: NotFound.
  virtual Result<LedgerReport> ReadLedgerReport() {
    return Status::NotFound("this rendezvous keeps no ledger");
  }
  // This node leaves the job for good because its workers kept failing: records `reason` and
  // the failing rank's last stderr lines in etcd for the other nodes (told at once) and `efdl
  // status`. Blocking (one etcd write); call before Leave(). Doubles need not override it.
  virtual Status RecordGiveUp(const std::string& reason,
                              const std::vector<std::string>& stderr_tail) {
    (void)reason;
    (void)stderr_tail;
    return Status::OK();
  }
  // This node's own workers kept failing (src/health/exclusion_rules.h): records `record` in
  // etcd (P excluded/<node>) for `efdl status`. Blocking (one etcd write); call before
  // Withdraw(). Doubles need not override it.
  virtual Status RecordExclusion(const ExclusionRecord& record) {
    (void)record;
    return Status::OK();
  }
  // Takes this node out of the job for `cooldown` without leaving for good: it announces that
  // it leaves (as Leave() does: the others re-round at once, a coordinator hands over), gives up
  // its lease and node key, so no round counts it, and drops the events not yet taken; once the
  // cool-down is over it registers again as a new member (as after a fence), and rounds follow
  // as for a node that just joined. Sooner when the job completes or is suspended meanwhile
  // (checked every few seconds): the next event then says so. Its exclusion record is deleted
  // when it registers again. Thread-safe (queued to the rendezvous' thread). Doubles need not
  // override it.
  virtual void Withdraw(std::chrono::milliseconds cooldown) { (void)cooldown; }
  // After kSuspended, once this node's workers stopped: records the newest snapshot step this
  // node found persisted (nullopt: none) for `efdl suspend` / `efdl status`. Blocking (one etcd
  // write); call before Leave(). Doubles that never emit kSuspended need not override it.
  virtual Status ReportSuspended(const std::optional<PersistedPoint>& persisted) {
    (void)persisted;
    return Status::OK();
  }
  // Stragglers (issue #32 part 3; src/health/straggler_rules.h). This node's summary of its
  // ranks' compute time, written under its lease (P compute/<node>; nothing while it holds
  // none). Thread-safe (queued to the rendezvous' thread). Doubles need not override it.
  virtual void PublishCompute(const ComputeRecord& record) { (void)record; }
  // Every node's latest summary, by node (one etcd range; blocking).
  virtual Result<std::map<std::string, ComputeRecord>> ReadCompute() {
    return std::map<std::string, ComputeRecord>{};
  }
  // The judge's record of the round's stragglers (P stragglers), and reading it back (nullopt:
  // none written). Blocking (one etcd request). Doubles need not override them.
  virtual Status RecordStragglers(const StragglerRecord& record) {
    (void)record;
    return Status::OK();
  }
  virtual Result<std::optional<StragglerRecord>> ReadStragglers() {
    return std::optional<StragglerRecord>{};
  }
};

// The etcd implementation: NewEtcdRendezvous in rendezvous/etcd_rendezvous.h.

}  // namespace efdl::rdzv
