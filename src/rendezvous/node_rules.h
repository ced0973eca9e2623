// A node's own decisions in the round protocol (protocol.h), as pure functions like the
// coordinator's in coordination.h: no etcd, no clock, no logging. etcd_rendezvous_node.cc
// carries them out; tests/rendezvous/interleaving_checker_test.cc drives them, with the
// coordinator's, over a model of etcd to check every interleaving of small jobs.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "rendezvous/coordination.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

// What a node knows of its own part in the job.
struct NodePart {
  std::string self;
  int64_t acked_round = 0;      // the newest round it acked
  int64_t started_round = 0;    // the round whose place it took (0: none since the last close)
  bool started_standby = false;
  int64_t fenced_round = 0;     // it was fenced out of every round up to this one
};

// A proposed round the node has not acked yet: it acks it.
bool ShouldAck(const RoundRecord& round, const NodePart& part);

// A node that held round `held_round` (0: none yet) and now applies a `round` whose proposal
// it never acked: it read that record directly (a takeover attempt or a re-read found the
// proposal already decided) and so skipped the proposal, and the coordinator marked it
// unresponsive. Active `round`: the proposal was round itself; gathering `round`: the proposal
// round-1 that did not form. It announces itself with a late ack of `round`: the coordinator
// takes it as a join during an active round (or makes it a standby) and counts it again while
// gathering. Found by the interleaving checker (issue #30): without it the node waited outside
// the round (active) or kept a job below MIN (gathering) until its join timeout. A node that
// registers now announces itself by registering (held_round 0).
bool AnnouncesLate(int64_t held_round, const RoundRecord& round, const NodePart& part);

// The node has taken a place that `round` ends (another round, or the same one leaving the
// active phase): it closes it (its workers stop).
bool ClosesStartedRound(const RoundRecord& round, const NodePart& part);

// The node may take its place in `round` (active, its assignment of that round in hand, not
// started yet, not fenced out of it).
bool MayStart(const RoundRecord& round, const std::optional<AssignRecord>& assign,
              const NodePart& part);

// SUCCESSION. Which coordinator a node follows (watches the node key of), and how many takeover
// steps after that key is deleted it takes over if the round record still names the dead
// coordinator:
//   - deputy j of the round record: after j steps;
//   - a node that runs no place of an active round (every node while the job gathers or a round
//     is proposed, a newcomer or standby during an active round): after kMaxDeputies steps,
//     spread by a random part of `spread_steps` more (so a crowd does not take over at once).
//     Without this, a proposal whose coordinator and deputies all died (a whole job restarted
//     within its TTL) would be followed by nobody: the job would wait out the join timeout;
//   - a member running its place of the active round follows nobody unless it is a deputy:
//     if the round breaks its workers fail, and a failure proposes the next round itself.
// The time to replace a dead coordinator is therefore bounded by its lease (TTL) plus at most
// (kMaxDeputies + spread_steps) takeover steps.
struct Succession {
  std::string follow;           // "" follows nobody
  int after_steps = 0;
  bool spread = false;          // add a random delay of up to kSpreadSteps steps
};
inline constexpr int kSpreadSteps = 4;
Succession WhomToFollow(const RoundRecord& round, const NodePart& part);

// THE FOLLOW WATCH (issue #37). A node keeps its watch of a coordinator's node key open when it
// stops following that coordinator (a member that takes its place follows nobody) and follows
// it again through the same watch when the next round is proposed: creating and cancelling it
// at each re-round cost 2N watch requests. A delivered deletion counts only as a watch started
// when the node (re)started following would have delivered it: one after `follow_after`, the
// revision it follows from (the round record's for the spread followers, the key's own for a
// deputy, which reads it first).
struct FollowWatch {
  std::string coordinator;    // whose node key is watched ("": none)
  int64_t from = 0;           // it delivers the changes after this revision
  int64_t deleted_at = 0;     // the newest deletion of that key it delivered (0: none)
};
// Whether `watch` delivers everything a watch of `coordinator`'s key started after
// `follow_after` would: the same key, watched from that revision or earlier. Otherwise the node
// replaces it by such a watch.
bool FollowWatchCovers(const FollowWatch& watch, const std::string& coordinator,
                       int64_t follow_after);
// Whether the coordinator the node follows (`followed`, from `follow_after`) is gone: its key's
// deletion after that revision was delivered.
bool FollowedIsGone(const FollowWatch& watch, const std::string& followed, int64_t follow_after);

// The record a node writes when its workers failed in the active round `round`: the next round,
// proposed by itself as coordinator (a failure usually means a peer died, and that peer may be
// the coordinator, whose lease takes a TTL to end). `lost_peer`: the failure was a collective
// that lost its peer, so the cause is on another node: the reason says so instead of calling
// this node's workers failed (the coordinator that forms the next round names the cause:
// coordination.h NameCause).
RoundRecord FailureProposal(const RoundRecord& round, const std::string& self,
                            const std::string& detail, bool lost_peer = false);

// The newest round a node fenced out of its registration (its lease lost) may never ack or
// start again under its next one: the round whose place it held, and a decided (active) round it
// knew of - its assignment may be in etcd. Not a round still gathering or proposed: the new
// registration takes part in that round like any newcomer (an ack of the old one went with its
// lease). Issue #37: 225 of 300 nodes whose leases expired while the job gathered never acked
// its proposal, which stayed below MIN for good.
int64_t FencedRound(const RoundRecord& round, const NodePart& part);

// OVERLOAD (issue #37). A job whose etcd (or whose machines) cannot keep up must slow down, not
// churn: thousands of nodes that lost their leases at once must not all register again at once,
// and a coordinator that keeps losing its lease must not be replaced again and again.
//
// How long a node waits before registration attempt `attempt` (0: the first after a fence, or
// the retry after a join that etcd did not answer), given how long its last registration took
// and `unit_random` in [0, 1). While etcd answers a registration within kSlowEtcd and this is
// the first attempt, nothing: a small or healthy job is not slowed. Otherwise a back-off that
// starts at the last registration's latency (at least kSlowEtcd), doubles per attempt up to
// kMaxJoinBackoff, and is spread by half of it at random (so a crowd arrives over the whole
// window, and never all at its start).
inline constexpr std::chrono::milliseconds kSlowEtcd{250};
inline constexpr std::chrono::milliseconds kMaxJoinBackoff{30000};
std::chrono::milliseconds JoinBackoff(int attempt, std::chrono::milliseconds last_join_latency,
                                      double unit_random);

// The lease TTL a node registers with after its lease expired `expiries` times (fenced by
// expiry, not by its own leaving): doubled per expiry up to 8x (at most kMaxAdaptedTtl, never
// below `ttl`). A node whose renewals cannot get through in time - its machine or etcd starved
// of CPU - then keeps its next lease instead of churning through fence and rejoin; the price is
// a slower detection of its crash by lease (worker failures still re-round at once).
inline constexpr std::chrono::milliseconds kMaxAdaptedTtl{120000};
std::chrono::milliseconds TtlAfterExpiries(std::chrono::milliseconds ttl, int expiries);

// Takeovers a node saw recently (the times the round record named a new coordinator that took
// over, oldest first, within kTakeoverPeriod): from the kMaxTakeoversPerPeriod-th one on, a
// node that would take over waits kTakeoverPeriod / kMaxTakeoversPerPeriod more per takeover
// over the bound, so at most about kMaxTakeoversPerPeriod happen per period plus one per such
// extra wait. With no recent takeover, nothing changes (the recovery bound above holds).
inline constexpr std::chrono::milliseconds kTakeoverPeriod{60000};
inline constexpr int kMaxTakeoversPerPeriod = 3;
std::chrono::milliseconds TakeoverBackoff(size_t recent_takeovers);

}  // namespace efdl::rdzv
