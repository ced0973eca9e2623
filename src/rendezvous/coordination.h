// The coordinator's decisions as pure functions (no etcd, no clock reads, no logging): what the
// coordinator knows of the job (JobView), how each event changes that, and what to do next.
// coordinator.h executes the decisions against etcd; protocol.h describes the protocol.
//
// Each function takes the view, the round record the node holds and the time where it needs
// one, updates the view and returns an action. Nothing here can fail: a decision that the
// executor cannot carry out (a lost CAS, an etcd error) ends in a re-read of the round record.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/protocol.h"

namespace efdl::rdzv {

using CoordClock = std::chrono::steady_clock;
using CoordTime = CoordClock::time_point;

// At most this many deputies are named in the round record.
inline constexpr size_t kMaxDeputies = 3;

// The job's identity (common/job_spec.h; node_id is the coordinating node's id) plus timing.
struct CoordinatorConfig : JobSpec {
  std::chrono::milliseconds last_call{0};
  std::chrono::milliseconds liveness_window{0};
  PlanLimits plan() const { return {min_nodes, max_nodes, world_size}; }
};

struct MemberInfo {
  int64_t create_revision = 0;
  NodeRecord record;
};

// The registered nodes (etcd's nodes/ keys) by id, and the same nodes in join order
// (create_revision, then id), kept together by the only two writers, Put and Erase
// (coordination.cc): the gathering step names the oldest nodes as deputies without walking them
// all (issue #37: it runs once per batch of joins, so a walk made forming N nodes O(N^2)).
class RegisteredNodes {
 public:
  using Map = std::map<std::string, MemberInfo>;
  RegisteredNodes() = default;
  RegisteredNodes(std::initializer_list<Map::value_type> nodes);

  void Put(const std::string& id, const MemberInfo& info);
  bool Erase(const std::string& id);   // whether it was there

  Map::const_iterator begin() const { return nodes_.begin(); }
  Map::const_iterator end() const { return nodes_.end(); }
  Map::const_iterator find(const std::string& id) const { return nodes_.find(id); }
  size_t count(const std::string& id) const { return nodes_.count(id); }
  size_t size() const { return nodes_.size(); }
  bool empty() const { return nodes_.empty(); }
  const std::set<std::pair<int64_t, std::string>>& by_join() const { return by_join_; }

 private:
  Map nodes_;
  std::set<std::pair<int64_t, std::string>> by_join_;
};

// The nodes whose newest ack is `ack` (resp. `done`) for round `round`: cheap counts that let the
// proposed and active steps skip their walk over every node until it can succeed.
struct RoundAcks {
  int64_t round = 0;
  std::set<std::string> ack, done;
};

// What the coordinator knows, from etcd's nodes/, ack/ and assign/ keys, and what it has decided
// to do but not done yet (a re-round). The functions below are its only writers. 17 fields, flat
// on purpose (issue #31): it is the input and output of pure functions, which the coordinator
// and the interleaving checker hold alike, and its sets are the coordinator's vocabulary
// (members, standbys, leaving, unresponsive) that coordination.cc reads across.
struct JobView {
  RegisteredNodes registered;
  std::map<std::string, AckRecord> acks;
  std::map<std::string, int> prev_rank;       // members of the last formed round -> node rank
  std::set<std::string> members, standbys, leaving, unresponsive;
  std::set<std::string> assign_keys;          // nodes with an assign/ key in etcd
  RoundAcks round_acks;                       // kept by OnAck, OnAckDeleted, OnNodeGone
  std::optional<CoordTime> min_reached_at;    // gathering: when MIN nodes were first there
  CoordTime last_progress{};                  // proposed: the last ack (or the proposal)
  // The liveness window in use: doubled (up to 8x the configured one) each time a node that
  // was left out for a late ack announces itself again, so a slow machine or etcd does not
  // cascade into round after round.
  std::chrono::milliseconds window{0};
  // The newest formed round (its members are prev_rank's keys) and its members whose node key
  // went since (their lease ended or they left): what RoundCause looks at.
  int64_t formed_round = 0;
  std::set<std::string> gone_members;
  bool reround = false;                       // an active round must be re-formed
  bool reround_graceful = true;               // ... at a commit (false once anyone crashed)
  std::string reround_why;

  void WantReround(bool graceful, std::string why);
};

// What the coordinator read of the job when it took over (one consistent etcd read).
struct JobSnapshot {
  struct Assign {
    std::string id;
    int64_t mod_revision = 0;
    std::optional<AssignRecord> record;       // nullopt: unreadable
  };
  std::vector<std::pair<std::string, MemberInfo>> nodes;
  std::vector<std::pair<std::string, AckRecord>> acks;
  std::vector<Assign> assigns;
};

// A fresh view of the job from `snap`, for the round record `round`. A coordinator that takes
// over an active round also decides whether it must re-form it: a member whose node key is gone,
// or a member registered again after its assignment (a restarted agent: its workers died).
JobView LoadJob(const JobSnapshot& snap, const RoundRecord& round, const CoordinatorConfig& cfg,
                CoordTime now);

// --- Events. Each returns the nodes to make standbys of (written by the executor, one txn
// each) and the lines for the job's history.
struct EventOutcome {
  std::vector<std::string> make_standby;
  std::vector<std::string> history;
};
EventOutcome OnNodeRegistered(JobView& v, const RoundRecord& round, const std::string& id,
                              const MemberInfo& info, const CoordinatorConfig& cfg);
EventOutcome OnNodeGone(JobView& v, const RoundRecord& round, const std::string& id);
EventOutcome OnAck(JobView& v, const RoundRecord& round, const std::string& id,
                   const AckRecord& ack, const CoordinatorConfig& cfg, CoordTime now);
void OnAckDeleted(JobView& v, const std::string& id);

// --- The step after a batch of events (or a timer).
struct StepAction {
  enum class Kind { kNone, kSetDeputies, kPropose, kFinalize, kComplete };
  Kind kind = Kind::kNone;
  std::vector<std::string> deputies;          // kSetDeputies
  bool graceful = true;                       // kPropose
  std::string why;                            // kPropose
};
StepAction DecideStep(JobView& v, const RoundRecord& round, const CoordinatorConfig& cfg,
                      CoordTime now);

// When DecideStep wants to run next (nullopt: only on an event).
std::optional<CoordTime> NextCoordinatorDeadline(const JobView& v, const RoundRecord& round,
                                                 const CoordinatorConfig& cfg);

// The record of a new proposal (round+1 unless gathering), with this node as coordinator; clears
// the pending re-round.
RoundRecord BeginProposal(JobView& v, const RoundRecord& round, const CoordinatorConfig& cfg,
                          bool graceful, const std::string& why);

// The cause of a round change, named when the next round is decided (issue #32): a worker
// failure usually reaches etcd first from a node whose collective lost its peer, not from the
// node that caused it (whose lease takes a TTL to end, or whose agent notices later). Each node's
// ack carries what its workers did in the formed round (AckRecord::prev_outcome); when at least
// one member's collective lost a peer, the cause is, in this order:
//   - a member whose own workers failed: "workers of node X failed: <how>";
//   - a member that is gone or did not answer the proposal: "node X is gone ..." / "node X
//     stopped answering ...";
//   - members whose workers all exited 0 (the job was not complete, or the round would have
//     been): "workers of node X failed: rank N exited 0 before the job completed"; those nodes
//     are told so in their next assignment (AssignRecord::early_exit) and count it.
// Otherwise (no collective lost a peer: a graceful change, a join, an own failure reported
// first) the proposal's reason stands: message is empty.
// While no member's report names the cause (only lost peers so far), the proposal is not
// decided before the liveness window after the last ack, even when every node acked: a node whose
// workers were still exiting (0) when it acked reports that in the window (DecideStep).
struct RoundCause {
  std::string message;
  std::vector<std::string> early_exit;
  bool named = false;   // an own failure, a missing member or an early exit named the cause
  bool lost = false;    // some member's collective lost a peer
};
RoundCause NameCause(const JobView& v, const RoundRecord& round);

// The end of a proposal: wait another window, give up on this proposal (a gathering record
// for round+1), or form the round (assignments to write, stale assignments to delete, and the
// active record to write after them). Marks the nodes that did not answer unresponsive.
struct FinalizeAction {
  enum class Kind { kWait, kNotFormed, kForm };
  Kind kind = Kind::kWait;
  RoundRecord next;
  std::vector<std::pair<std::string, AssignRecord>> writes;
  std::vector<std::string> stale;
  Plan plan;
  std::string history;
};
FinalizeAction DecideFinalize(JobView& v, const RoundRecord& round, const CoordinatorConfig& cfg);
// The assignments of a kForm action are in etcd: the view takes the new round's members.
void AssignmentsWritten(JobView& v, const FinalizeAction& formed);

// Standby bookkeeping once its assign key is written; returns the history line.
std::string StandbyAssigned(JobView& v, const std::string& id, const CoordinatorConfig& cfg);

// The complete record of an active round every member of which reported done.
RoundRecord CompletionRecord(const RoundRecord& round);

// Candidates for PlanRound: acked_only = the nodes that acked this round's proposal, else every
// registered node not known unresponsive; leaving nodes never.
std::vector<Candidate> Candidates(const JobView& v, const RoundRecord& round, bool acked_only);

// Succession, decided by a node that is not (or no longer) the coordinator:
// - a node that finds the coordinator gone takes over: the record it writes (a new proposal
//   unless the job is gathering);
RoundRecord TakeOverRecord(const RoundRecord& round, const std::string& self);
// Whether `next` is the record a node wrote taking over from `prev`'s vanished coordinator.
bool IsTakeOver(const RoundRecord& prev, const RoundRecord& next);
// - a coordinator that leaves hands over to `successor` (a graceful change).
RoundRecord HandOverRecord(const RoundRecord& round, const std::string& self,
                           const std::string& successor);

}  // namespace efdl::rdzv
