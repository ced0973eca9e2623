// The masterless rendezvous protocol: etcd keys, their records, and the pure round planner.
//
// KEYS (P = /efdl/<job>/)
//   P nodes/<node>   lease-bound; {addr, nproc}. create_revision = join order.
//   P round          the one small record every node watches (~200 bytes, size independent of N):
//                    {r, ph, c (coordinator), d (deputies), g (graceful), w, n, ma, mp, hp, as,
//                    msg}; as: mp is the rank-0 node's agent store (src/agent/agent_store.h).
//   P assign/<node>  written by the coordinator only; {r, rank, off, sb, cr, cs, hosts, ha, ee,
//                    pn, pa, pp}:
//                    this node's place in round r (cr/cs/hosts/ha: Horovod's layout, see
//                    AssignRecord; ee: its workers' exit 0 broke the previous round, issue #32;
//                    pn/pa/pp: its peer-copy successor, issue #35 part 2).
//                    Each node watches only its own assign key.
//   P ack/<node>     lease-bound; {r, st: ack|done|failed|leaving, port, hp, pc, as, rs (restarts),
//                    pr, po, pd (what its workers did in round pr: done|failed|lost, and how)}.
//                    Written by the node itself; only the coordinator watches the ack/ prefix.
//                    The coordinator that forms a round names its cause from po (coordination.h
//                    NameCause).
//   P program        lease-bound to the node that wrote it; the program (script name) of the
//                    job's nodes. The registration txn of a node that names its program
//                    compares it (registration.h Open): the check costs no request while the
//                    writer lives. Once it is gone, the next node to join reads the live nodes'
//                    records (2 point reads, at most a range of 2) and writes it again.
//   P status         written by the coordinator once per round for `efdl status` (never watched).
//   P complete       present once every member of a round reported success.
//   P suspended/<node>  not lease-bound; {step (int or null), t, seq, epoch}: written by each
//                    agent of a suspended job once its workers stopped: the newest snapshot it
//                    found persisted in storage. The job resumes from the report with the highest
//                    seq (suspend.h JobSuspendPoint).
//   P gaveup/<node> not lease-bound; {reason, t, stderr: the failing rank's last stderr lines}:
//                    written by an agent that spent its
//                    --max-restarts, before it leaves; watched by every node (they print it, and
//                    one whose own workers failed too ends once fewer than MIN nodes remain).
//   P excluded/<node> not lease-bound; {reason, t, until, failures, n, stderr}: written by an agent
//                    whose own workers failed --exclude-after times within --exclude-window
//                    (src/health/exclusion_rules.h) before it withdraws from the job for its
//                    cool-down (no lease, no node key, so no round counts it); deleted by that
//                    agent when it registers again. Read by `efdl status` only.
//
// ROUND LIFE (phases of P round)
//   gathering(r)  the coordinator waits for >= MIN registered nodes, then for MAX or --last-call.
//   proposed(r)   every registered node acks r with a freshly picked free port, or the port of
//                 its agent store (as: true). The coordinator
//                 waits until every node it knows acked, or until no new ack came for the
//                 liveness window; nodes that did not ack are left out (they re-announce with a
//                 late ack, which counts as a join).
//   active(r)     the coordinator wrote assign/<node> for every acked node (batched txns of at
//                 most 128 puts, etcd's default --max-txn-ops), then the round record with the
//                 master address/port (the rank-0 node's offer). A node starts when it has both.
//   complete      every member of the active round acked `done`.
//   suspended     written by `efdl suspend` (CAS on P round, so it beats any proposal in
//                 flight; c is empty). Every node stops its workers gracefully, writes
//                 P suspended/<node> and leaves; a node that joins meanwhile is refused.
//                 `efdl resume` replaces it with gathering(r+1) without a coordinator: the
//                 first node to join takes over as for a vanished coordinator.
//
// ONE WRITER, CAS EVERYWHERE. Every write of P round is a txn guarded by the mod_revision the
// writer last saw, so exactly one proposer wins each change. Whoever wins a proposal becomes the
// coordinator (field c) and watches nodes/ and ack/; a coordinator that loses a CAS re-reads
// and steps down if c is no longer itself. Proposers other than the coordinator:
//   - the first node to Join creates P round (create-only) and coordinates gathering;
//   - a node whose workers failed (ReportWorkerFailure, ReportLostPeer) proposes r+1 itself: the
//     failure usually means a peer died, and that peer may be the coordinator, whose lease would
//     take a TTL to expire. Redundant reports lose the CAS and just ack;
//   - up to 3 deputies named in P round (the oldest other nodes) watch the coordinator's node
//     key; when it is deleted, deputy j waits j x 250 ms, and, if P round still names the dead
//     coordinator, takes over by CAS (no herd: the members that run a place and are no deputy
//     never take over; they keep their watch of that key open from the last proposal, so its
//     deletion reaches them too, and they only note it: node_rules.h FollowWatch);
//   - a joining node that finds P round's coordinator key missing takes over by CAS;
//   - every node that runs no place of an active round (all nodes while the job gathers or a
//     round is proposed; newcomers and standbys of an active round) follows the coordinator too,
//     after the deputies plus a random spread (node_rules.h WhomToFollow), so a whole job that
//     died within its TTL is taken over by the nodes that replace it;
//   - a node that finds a proposal decided without it (it skipped the proposed record) sends a
//     late ack, taken as a join (node_rules.h AnnouncesLate).
//
// INVARIANTS (checked over every explored interleaving of small jobs by
// tests/rendezvous/interleaving_checker_test.cc; the model and what it abstracts: docs/scale.md):
//   - safety: in every round, the members that started hold distinct node ranks, disjoint rank
//     ranges and that round's assignment; no node starts a round older than the round record it
//     holds; no node's started or acked round, and not P round's number, ever goes back;
//   - liveness: once faults stop, if at least MIN live nodes stay registered, a round forms in
//     which every live node has a place (member, or standby at MAX).
// RECOVERY BOUND: a dead coordinator is replaced at most TTL (its lease, from its last renewal)
// + (3 + 4) x takeover_step after it died, by whichever live node remains; the round then forms
// within the liveness window (doubled, up to 8x, for each node left out and back). Under
// overload the bound stretches on purpose (node_rules.h, issue #37): a node whose lease expired
// registers again with a longer TTL (up to 8x), and from the 3rd takeover a node saw within a
// minute each further takeover waits 20 s more.
//
// STABLE RANKS. Members of the previous round keep their relative order; new members go after
// them in join order (create_revision); at most MAX members, the rest are standbys.
//
// COST PER ROUND (N nodes): 1 proposal + N acks + ceil(N/128) assignment txns + 1 activation +
// 1 status write: N + N/128 + 3 requests. Watch events: N (proposal) + N (acks, to the
// coordinator only) + N (each node its own assignment) + N (activation). Bytes O(N) in total;
// nothing of size O(N) is sent to more than one node.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/job_spec.h"
#include "efdl/status.h"

namespace efdl::rdzv {

// Key layout of one job.
struct JobKeys {
  explicit JobKeys(const std::string& job_id);
  std::string prefix;          // JobKeyPrefix(job): /efdl/<job>/
  std::string nodes;           // prefix + "nodes/"
  std::string assign;          // prefix + "assign/"
  std::string ack;             // prefix + "ack/"
  std::string round;
  std::string program;         // prefix + "program" (see KEYS)
  std::string status;
  std::string complete;
  std::string suspended;       // prefix + "suspended/"
  // prefix + "gaveup/": one record per node that left the job for good after its workers kept
  // failing (GaveUpRecord); no lease, so `efdl status` shows it after the node is gone.
  std::string gaveup;
  // prefix + "excluded/": one record per node in its cool-down (ExclusionRecord).
  std::string excluded;
  // prefix + "compute/": each node's latest summary of its ranks' compute time per step, under
  // its lease (ComputeRecord; issue #32 part 3, src/health/straggler_rules.h).
  std::string compute;
  // prefix + "stragglers": the judge's (node rank 0 of the round) record of the round's
  // stragglers (StragglerRecord); no lease, so `efdl status` shows it after the judge changed.
  std::string stragglers;
  std::string Compute(const std::string& id) const { return compute + id; }
  std::string Node(const std::string& id) const { return nodes + id; }
  std::string GaveUp(const std::string& id) const { return gaveup + id; }
  std::string Excluded(const std::string& id) const { return excluded + id; }
  std::string Suspended(const std::string& id) const { return suspended + id; }
  std::string Assign(const std::string& id) const { return assign + id; }
  std::string Ack(const std::string& id) const { return ack + id; }
};

// Job ids and node ids: the one rule of common/job_spec.h.
using efdl::ValidateId;

enum class Phase { kGathering, kProposed, kActive, kComplete, kSuspended };
const char* PhaseName(Phase phase);

struct RoundRecord {
  int64_t round = 0;
  Phase phase = Phase::kGathering;
  std::string coordinator;
  std::vector<std::string> deputies;
  bool graceful = false;       // the change that ended the previous round was orderly
  int world_size = 0;          // active: sum of nproc
  int nnodes = 0;              // active: members
  std::string master_addr;     // active
  uint16_t master_port = 0;    // active
  uint16_t horovod_port = 0;   // active, "hp": the rank-0 node's Horovod Gloo rendezvous (0: none)
  bool agent_store = false;    // active, "as": master_port is the rank-0 node's agent store
  std::string message;         // why the round changed (for logs)

  std::string Encode() const;
  static Result<RoundRecord> Decode(const std::string& text);
};

struct NodeRecord {
  std::string addr;
  int nproc = 1;
  std::string program;   // field "prog": RendezvousOptions::program ("" when not given)
  std::string metrics;   // field "metrics": the agent's Prometheus endpoint HOST:PORT ("": none)
  std::string Encode() const;
  static Result<NodeRecord> Decode(const std::string& text);
};

// Where a node sends the peer copy of its per-rank arenas (issue #35 part 2, docs/snapshots.md
// "Peer copy"): its ring successor's node id, advertise address and peer-copy port. port 0: no
// peer (a round of one node, the successor offered none, or an older coordinator).
struct PeerCopyTarget {
  std::string node{};
  std::string addr{};
  uint16_t port = 0;
  bool operator==(const PeerCopyTarget&) const = default;
};

struct AssignRecord {
  int64_t round = 0;
  int node_rank = 0;
  int rank_offset = 0;
  bool standby = false;
  // Horovod's place of each local rank (MemberAssignments). "cr"/"cs" only when the round's
  // nodes run different numbers of processes (else cross rank = node rank, size = nnodes);
  // "hosts" (every member's id and nproc, rank order) only in the rank-0 node's record, which
  // serves the Gloo rendezvous: O(N) bytes, but to that one node only.
  std::vector<int> cross_rank{};
  std::vector<int> cross_size{};
  std::vector<std::pair<std::string, int>> hosts{};
  // "ha": the members' distinct advertise addresses, with "hosts" only: the Gloo rendezvous
  // server answers these clients only (real Horovod cannot send the job's secret).
  std::vector<std::string> host_addrs{};
  // "ee" (issue #32): this node's workers all exited 0 in the previous round before the job was
  // complete, and their peers' collectives lost them (coordination.h RoundCause): the node
  // counts that round as its own failure.
  bool early_exit{};
  // "pn", "pa", "pp" (issue #35 part 2): the ring successor this node copies its per-rank arenas
  // to (PeerCopyRing); absent in older records: no peer. O(1) bytes per node.
  PeerCopyTarget peer_copy{};
  std::string Encode() const;
  static Result<AssignRecord> Decode(const std::string& text);
};

enum class AckState { kAck, kDone, kFailed, kLeaving };

// AckRecord::prev_outcome: the node's workers all exited 0; one of them failed on its own (its
// code raised or exited non-zero, it hung, it was killed); one failed because a collective lost
// its peer (the cause is on another node).
inline constexpr const char* kOutcomeDone = "done";
inline constexpr const char* kOutcomeFailed = "failed";
inline constexpr const char* kOutcomeLost = "lost";
const char* AckStateName(AckState state);

struct AckRecord {
  int64_t round = 0;
  AckState state = AckState::kAck;
  uint16_t port = 0;           // kAck: a free port this node offers as MASTER_PORT
  int restarts = 0;            // worker failures this node reported so far
  uint16_t horovod_port = 0;   // kAck, "hp": a second free port, for the Horovod rendezvous
  // kAck, "pc": the port this node's agent receives peer copies on (src/agent/peer_copy.h; 0:
  // none, as from an older agent).
  uint16_t peer_copy_port = 0;
  // kAck, "as": `port` is this node's agent store (a TCPStore server its agent keeps for its
  // whole life, src/agent/agent_store.h), not a free port.
  bool agent_store = false;
  // "np": why this node runs without pre-started workers, every round change starting its
  // workers cold ("": it has them, or it runs with --no-prestart, or it is an older agent).
  std::string no_prestart{};
  // What this node's workers did in round `prev_round`, the round it last ran workers in
  // (issue #32; 0: nothing reported since): "pr", "po" (kOutcome*), "pd" (the detail: the failing
  // rank and how, or the ranks that exited 0). Sent with every ack until the node starts its
  // next round, so the coordinator that forms the next round has every member's outcome and
  // names the round's cause from them (coordination.h RoundCause).
  int64_t prev_round{};
  std::string prev_outcome{};
  std::string prev_detail{};
  std::string Encode() const;
  static Result<AckRecord> Decode(const std::string& text);
};

// P suspended/<node>: one agent's report after its workers stopped for a suspend.
struct SuspendReport {
  std::optional<int64_t> step;   // newest snapshot step found persisted; nullopt: none
  std::string time;              // ISO-8601 UTC
  // That snapshot's commit sequence number (orders snapshots across epochs, where "step" may
  // restart at 0) and its "epoch" keyword argument, when known (agents before 2026-12-03 sent
  // neither).
  std::optional<uint64_t> seq;
  std::optional<int64_t> epoch;
  std::string Encode() const;
  static Result<SuspendReport> Decode(const std::string& text);
};

// P gaveup/<node>: a node that left the job for good because its workers kept failing.
struct GaveUpRecord {
  std::string reason;            // e.g. "rank 1 exited with status 1 in round 4; 4 failures ..."
  std::string time;              // ISO-8601 UTC
  // The last lines the failing rank wrote to stderr (its traceback, usually), oldest first;
  // field "stderr" (absent in records of agents before 2026-12-04).
  std::vector<std::string> stderr_tail;
  std::string Encode() const;
  static Result<GaveUpRecord> Decode(const std::string& text);
};

// P excluded/<node>: a node excluded from the job's rounds for a cool-down because its own
// workers kept failing (issue #32; src/health/exclusion_rules.h).
struct ExclusionRecord {
  std::string reason;            // the last failure and the count, e.g. "rank 1 exited ..."
  std::string time;              // ISO-8601 UTC, when it was excluded
  std::string until;             // ISO-8601 UTC, when it may rejoin (the end of its cool-down)
  int failures = 0;              // its own failures within the window that excluded it
  int exclusion = 0;             // which exclusion of this node's agent (1: the first)
  std::vector<std::string> stderr_tail;   // the failing rank's last stderr lines, oldest first
  // What excluded it: "" (its own failures) or "straggler" (--evict-stragglers; issue #32 part
  // 3, failures 0). Field "cause", absent in records of agents before 2026-12-06.
  std::string cause;
  std::string Encode() const;
  static Result<ExclusionRecord> Decode(const std::string& text);
};

// P compute/<node>: a node's summary of its ranks' compute time per step over the last period
// (src/health/straggler_rules.h ComputeWindow), written every period under the node's lease.
struct ComputeRecord {
  int64_t round = 0;
  int64_t seq = 0;                        // the node's summary number, from 1
  std::map<int, double> compute_s;        // global rank -> seconds of compute per step
  std::string Encode() const;
  static Result<ComputeRecord> Decode(const std::string& text);
};

// P stragglers: the round's stragglers as the judge found them (issue #32 part 3).
struct StragglerRecord {
  struct Node {
    std::string id;
    std::vector<int> ranks;               // its slow ranks (global)
    double compute_s = 0;                 // its slowest rank's compute time per step
    double median_s = 0;                  // the median of the other nodes' ranks
    int windows = 0;                      // consecutive slow summaries
    std::string since;                    // ISO-8601 UTC, when it was named
  };
  int64_t round = 0;
  std::string judge;                      // the node that judged
  std::string time;                       // ISO-8601 UTC of the record
  double factor = 0;                      // --straggler-factor
  double window_s = 0;                    // --straggler-window
  std::vector<Node> nodes;                // empty: none now
  std::string Encode() const;
  static Result<StragglerRecord> Decode(const std::string& text);
};

// P status: what the coordinator wrote for `efdl status` (members, standbys, recent events).
// Decoding is lenient, since the record is informational: entries of the wrong shape are
// skipped so that one bad entry does not hide the rest; only a value that is not a JSON object
// is an error.
struct StatusRecord {
  struct Member {
    std::string id;
    std::string addr;
    int nproc = 0;
    int rank = -1;
  };
  struct Event {
    std::string time;
    std::string message;
  };
  std::vector<Member> members;
  std::vector<std::string> standbys;
  std::vector<Event> events;
  static Result<StatusRecord> Decode(const std::string& text);
};

// One node the planner may place.
struct Candidate {
  std::string id;
  int64_t create_revision = 0;  // join order
  int nproc = 1;
  std::string addr;
  uint16_t port = 0;             // its offered master port
  bool agent_store = false;      // `port` is its agent store
};

struct PlannedNode {
  std::string id;
  int node_rank = 0;
  int rank_offset = 0;
  int nproc = 0;
  std::string addr;              // its advertise address (Horovod's server admits only these)
};

struct Plan {
  bool formed = false;           // false: too few nodes (or procs, in fragmented mode)
  std::vector<PlannedNode> members;   // in rank order
  std::vector<std::string> standbys;
  int world_size = 0;
  std::string master_addr;
  uint16_t master_port = 0;
  bool agent_store = false;      // master_port is the first member's agent store
};

struct PlanLimits {
  int min_nodes = 1;
  int max_nodes = 1;
  int world_size = 0;            // >0: members' nproc must sum to exactly this
};

// Orders and caps the candidates: previous members (`previous_rank`: node id -> its node rank
// in the last round) first in their old order, then the others in join order; the first MAX are
// members. O(N log N). Fragmented mode (world_size > 0): plan::ChooseFragmentMembers over that
// order picks nodes whose procs sum to exactly world_size (fewest, then largest, then earliest
// in the order, so running members stay); formed only if their count is within MIN..MAX. The
// members keep the order (ranks contiguous per node), every other candidate is a standby.
Plan PlanRound(const std::vector<Candidate>& candidates,
               const std::map<std::string, int>& previous_rank, const PlanLimits& limits);

// The assign records of a formed plan's members, in plan order, with Horovod's layout: the
// cross rank of local rank l on a node = members before it with more than l processes, the
// cross size = all such members (Horovod's Gloo runner numbers them so). O(world size).
std::vector<AssignRecord> MemberAssignments(int64_t round, const Plan& plan);

// The peer-copy ring of a formed plan (issue #35 part 2): for each member in plan (node-rank)
// order, its successor's target (member i+1, the last one's is member 0), with the port
// `port_of(id)` that successor offered in its ack of this round; an empty target when the plan
// has fewer than 2 members or the successor offered no port. Data only: no decision of the
// round depends on it.
std::vector<PeerCopyTarget> PeerCopyRing(
    const Plan& plan, const std::function<uint16_t(const std::string&)>& port_of);

}  // namespace efdl::rdzv
