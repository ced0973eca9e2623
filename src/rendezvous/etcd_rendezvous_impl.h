// Private to src/rendezvous: the EtcdRendezvous class, whose driver (etcd_rendezvous.cc) and
// node side (etcd_rendezvous_node.cc) live in two files. Nothing outside src/rendezvous
// includes this; the agent makes one through NewEtcdRendezvous (etcd_rendezvous.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "rendezvous/coordinator.h"
#include "rendezvous/driver_pool.h"
#include "rendezvous/node_books.h"
#include "rendezvous/node_rules.h"
#include "rendezvous/protocol.h"
#include "rendezvous/registration.h"
#include "rendezvous/rendezvous.h"

namespace efdl::rdzv::internal {

struct Input {
  enum class Type {
    kRound, kAssign, kNodes, kAcks, kCoordDeleted, kLeaseLost, kWorkerFailure, kWorkersSucceeded,
    kResync, kGaveUp, kWithdraw, kPublishCompute, kRestarts, kWorkersReturned
  };
  Type type = Type::kRound;
  uint64_t generation = 0;              // watch inputs: the registration/watch set they belong to
  std::vector<etcd::WatchEvent> events;
  int64_t round = 0;
  int64_t lease = 0;
  int64_t revision = 0;                 // kCoordDeleted: of the deletion (INT64_MAX: watch broke)
  std::string detail;
  bool coordinator_watch = false;       // kResync from a coordinator watch (nodes/ or ack/)
  bool lost_peer = false;               // kWorkerFailure: ReportLostPeer
  std::chrono::milliseconds delay{0};   // kWithdraw: the cool-down
};

// The node's driver: the inputs its watches and the agent's calls queue, and the one place its
// steps run - a thread of its own, or its strand on a DriverPool (efdl sim), never two at once.
// Push only queues (under mu_, never held while the node calls etcd or destroys a watch), so a
// watch callback never blocks the client's shared watch thread.
class NodeDriver {
 public:
  // One step: the queued inputs (then the node's timers); and when the timers are due next.
  using Step = std::function<void(std::deque<Input>&)>;
  using Deadline = std::function<std::optional<TimePoint>()>;

  explicit NodeDriver(DriverPool* pool) : pool_(pool) {}
  ~NodeDriver() { Stop(); }
  NodeDriver(const NodeDriver&) = delete;
  NodeDriver& operator=(const NodeDriver&) = delete;

  // Hands the node to its driver (Join); its first step runs at once.
  void Start(Step step, Deadline deadline);
  bool started() const { return step_ != nullptr; }
  // Queues an input (any thread); dropped once stopped.
  void Push(Input in);
  // No more inputs or steps: the thread is joined, the strand closed. False when it was
  // stopped before.
  bool Stop();

 private:
  void Loop();
  std::optional<TimePoint> PoolStep();

  DriverPool* const pool_;        // null: the node has its own driver thread
  Step step_;
  Deadline deadline_;
  Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<Input> inputs_ EFDL_GUARDED_BY(mu_);
  bool stop_ EFDL_GUARDED_BY(mu_) = false;
  bool driving_ EFDL_GUARDED_BY(mu_) = false;   // Start handed the node to the pool
  std::thread thread_;
  std::shared_ptr<DriverPool::Strand> strand_;  // on pool_, from Start on
};

inline Event MakeEvent(Event::Type type, int64_t round, bool graceful, std::string message) {
  Event e;
  e.type = type;
  e.round = round;
  e.graceful = graceful;
  e.message = std::move(message);
  return e;
}

// One node's side of the protocol. Owns the NodeDriver (its thread, or with a DriverPool its
// strand on the pool: the same steps, on a thread shared with other nodes), this node's
// Registration and the Coordinator it runs while the round record names it (as that
// coordinator's host).
//
// 19 data members, on purpose (issue #31): what is left is the node's own state machine. Its
// handles (client, options, keys), the three collaborators that cross threads (driver, events,
// the agent's notes), its two rooms (Registration, Coordinator), the books and clocks of
// node_books.h (one job each, and their generator), whether it finished, and the facts the
// node's decisions in node_rules.h read - the round record it holds with its revision, its
// assignment, its NodePart - which the interleaving checker's Node keeps field for field
// (tests/rendezvous/interleaving_checker_test.cc). Wrapping those would only hide them from the
// code that mirrors them.
class EtcdRendezvous final : public Rendezvous, private CoordinatorHost {
 public:
  EtcdRendezvous(etcd::Client& client, RendezvousOptions options, DriverPool* pool = nullptr)
      : client_(client),
        opt_(std::move(options)),
        keys_(opt_.job_id),
        driver_(pool),
        registration_(client_, keys_, opt_.job_id, opt_.node_id, RegistrationCallbacks()),
        coordinator_(client_, keys_,
                     {static_cast<const JobSpec&>(opt_), opt_.last_call, opt_.liveness_window},
                     *this),
        part_{opt_.node_id} {}
  ~EtcdRendezvous() override { Leave(); }

  Status Join() override;
  std::optional<Event> WaitEvent(std::chrono::milliseconds timeout) override;
  void ReportWorkerFailure(int64_t round, const std::string& detail) override;
  void ReportLostPeer(int64_t round, const std::string& detail,
                      const std::string& cause) override;
  void ReportWorkersSucceeded(int64_t round) override { ReportWorkersExited0(round, ""); }
  void ReportWorkersExited0(int64_t round, const std::string& ranks) override;
  void NoteWorkersReturned(int64_t round, const std::string& ranks) override;
  void Leave() override;
  Status ReportSuspended(const std::optional<PersistedPoint>& persisted) override;
  Status RecordGiveUp(const std::string& reason,
                      const std::vector<std::string>& stderr_tail) override;
  Status RecordExclusion(const ExclusionRecord& record) override;
  void Withdraw(std::chrono::milliseconds cooldown) override;
  bool MayPublish(double committed_at) const override {
    return registration_.MayPublish(committed_at);
  }
  void OfferAgentStore(uint16_t port) override { notes_.SetAgentStorePort(port); }
  void OfferPeerCopy(uint16_t port) override { notes_.SetPeerCopyPort(port); }
  // The count is in this node's ack (`efdl status` RESTARTS): the ack last sent is sent again
  // with it (on the driver thread, after any ack queued before).
  void ReportRestarts(int restarts) override;
  Status RecordLedger(const LedgerPart& part) override;
  Status RecordLedgerEnd(const LedgerEnd& end) override;
  Result<LedgerReport> ReadLedgerReport() override;
  void PublishCompute(const ComputeRecord& record) override;
  Result<std::map<std::string, ComputeRecord>> ReadCompute() override;
  Status RecordStragglers(const StragglerRecord& record) override;
  Result<std::optional<StragglerRecord>> ReadStragglers() override;
  void NoteNoPrestart(const std::string& why) override { notes_.SetNoPrestart(why); }

 private:
  // --- plumbing ---
  Registration::Callbacks RegistrationCallbacks();
  void Push(Input in);
  // What this node's workers did in `round` (a failure, a success, a return), as an input.
  void PushOutcome(Input::Type type, int64_t round, std::string detail, bool lost_peer = false);
  void Emit(Event e);
  // One step of the driver: the queued inputs, then the timers and the coordinator's step. The
  // driver thread loops over it; a DriverPool runs it as the node's strand.
  void RunBatch(std::deque<Input>& batch);
  void Handle(Input& in);
  void Resync();
  std::optional<TimePoint> NextDeadline() const;
  void OnTimers();
  // While this node waits for a round: a line every Unplaced::kNoticeInterval saying for what,
  // from what the node holds; while the job gathers, with the count of registered nodes that
  // CountRegistered took on its own, bounded clock (node_books.h Unplaced; issue #37).
  void WaitNotice(TimePoint now);
  void CountRegistered(TimePoint now);
  // A peer gave up and this node's own workers failed too: end the job here as well when fewer
  // than MIN nodes remain (no round can form), instead of waiting out the join timeout.
  void CheckEveryNodeFailed();
  etcd::WatchCallback WatchInto(Input::Type type, uint64_t generation);

  // --- CoordinatorHost ---
  const RoundRecord& round() const override { return round_; }
  int64_t round_revision() const override { return round_mod_rev_; }
  bool CasRound(const RoundRecord& rec) override { return CasRoundAt(rec, round_mod_rev_); }
  void RereadRound() override;
  void ApplyRound(const RoundRecord& rec, int64_t mod_rev) override;
  etcd::WatchCallback CoordinatorWatch(bool nodes, uint64_t generation) override {
    return WatchInto(nodes ? Input::Type::kNodes : Input::Type::kAcks, generation);
  }
  void RequestResync() override;

  // --- node side ---
  Status Register();           // Registration::Open, then take the round it read
  // Join() found the node id taken: waits (up to the join timeout) while the holder's lease is
  // not being renewed — the registration of a previous agent of this node that died — and
  // registers once it expired; returns `taken` as soon as the lease is seen renewed (a live
  // agent uses the id).
  Status WaitOutStaleRegistration(Status taken);
  void TryStart();
  void SendAck(AckState state, int64_t round);
  // The workers' outcome of `round` (AckRecord::prev_outcome), sent now with the ack it belongs
  // to: a failure or success of the round still acked, or a re-sent ack of a proposal acked
  // before the agent saw its workers end (the coordinator forming it names the cause from it).
  void NoteOutcome(int64_t round, const char* outcome, const std::string& detail,
                   std::optional<AckState> report);
  bool CasRoundAt(const RoundRecord& rec, int64_t expect_mod_rev);   // true when we won
  const NodePart& Part() const { return part_; }   // this node's part, for node_rules.h
  void UpdateDeputyWatch();
  void OnCoordinatorGone(const std::string& coordinator);
  void TakeOver();
  void Fence(const std::string& why);
  void Fail(const std::string& message);
  // kWithdraw (Rendezvous::Withdraw): out of the job, announced, until the cool-down ends.
  void WithdrawFor(std::chrono::milliseconds cooldown);
  // While withdrawn: registers again once the cool-down is over, or at once when the job
  // completed or was suspended meanwhile (read every kWithdrawnCheck).
  void CheckWithdrawn(TimePoint now);
  void ReleaseRegistration(bool announce_leaving);
  // A coordinator that leaves names its successor and proposes the next round itself (graceful).
  void HandOverCoordination();
  int64_t CurrentRoundForEvents() const;
  // P round says suspended: emit kSuspended once and stop all protocol work; the lease stays
  // until the agent's Leave(), so `efdl suspend` sees the node until its workers are down.
  void OnSuspended(const RoundRecord& rec);
  // Out of every round (fenced, suspended): no started round, no coordination, no watch of the
  // round, the assignment or the coordinator; the lease is the caller's business.
  void StopTakingPart();

  etcd::Client& client_;
  const RendezvousOptions opt_;
  const JobKeys keys_;

  NodeDriver driver_;
  EventQueue events_;
  AgentNotes notes_;                    // set by the agent's thread

  // Everything below is owned by the driver thread (and by Join before the thread starts, and
  // by Leave after it stopped).
  Registration registration_;
  Coordinator coordinator_;
  NodePart part_;                       // acked, started, fenced rounds (node_rules.h)
  JobEndCheck end_check_;
  AckBook acks_;
  Unplaced unplaced_;
  TakeoverClock takeover_;                      // whom this node follows (UpdateDeputyWatch)
  RejoinClock rejoin_;
  std::mt19937_64 rng_{std::random_device{}()}; // the spreads of a takeover and of a rejoin
  RoundRecord round_;
  int64_t round_mod_rev_ = 0;
  std::optional<AssignRecord> assign_;
  bool finished_ = false;               // complete, failed or left: no more protocol work
  double UnitRandom() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }
};

}  // namespace efdl::rdzv::internal
