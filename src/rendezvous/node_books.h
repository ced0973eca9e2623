// Private to src/rendezvous: the books an EtcdRendezvous (etcd_rendezvous_impl.h) keeps, one
// room each, so that the node's class holds its collaborators instead of their fields (issue #31):
//   EventQueue   the events for the agent (the driver pushes, the agent's thread waits);
//   AgentNotes   what the agent's thread tells the node for its acks;
//   AckBook      what this node told in its ack key, and the outcome it still has to tell;
//   JobEndCheck  after a peer gave up: whether this node's own break ends the job here too;
// and its clocks:
//   PacedCount     the pace of a count of the registered nodes (Unplaced's, JobEndCheck's);
//   Unplaced       while the node has no place: since when, and its waiting notices;
//   TakeoverClock  whom it follows, when it takes over from them, the takeovers it saw;
//   RejoinClock    after a fence or a withdrawal: when it registers again, until when it may try,
//                  and what its registrations took (latency, lease expiries: the overload rules).
// The decisions stay in node_rules.h; these only keep what the node did and when it is due again.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "common/job_rate.h"
#include "common/thread_annotations.h"
#include "rendezvous/node_rules.h"
#include "rendezvous/protocol.h"
#include "rendezvous/rendezvous.h"

namespace efdl::rdzv::internal {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

// The events for the agent (Rendezvous::WaitEvent): pushed on the driver, taken on the agent's
// thread.
class EventQueue {
 public:
  void Push(Event e) {
    {
      MutexLock lock(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }
  std::optional<Event> Wait(std::chrono::milliseconds timeout) {
    MutexLock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&]() EFDL_REQUIRES(mu_) { return !events_.empty(); })) {
      return std::nullopt;
    }
    Event e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  // The events of a registration just released are stale (Withdraw): the agent hears of rounds
  // again once the node has registered anew.
  void Clear() {
    MutexLock lock(mu_);
    events_.clear();
  }

 private:
  Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<Event> events_ EFDL_GUARDED_BY(mu_);
};

// What the agent's thread tells the node for its acks (ReportRestarts, OfferAgentStore,
// OfferPeerCopy, NoteNoPrestart); read on the driver when it writes an ack.
class AgentNotes {
 public:
  void SetRestarts(int restarts) { restarts_.store(restarts); }
  // The agent's count of restarts; nullopt before its first ReportRestarts.
  std::optional<int> restarts() const {
    const int n = restarts_.load();
    return n >= 0 ? std::optional<int>(n) : std::nullopt;
  }
  void SetAgentStorePort(uint16_t port) { agent_store_port_.store(port); }
  uint16_t agent_store_port() const { return agent_store_port_.load(); }
  void SetPeerCopyPort(uint16_t port) { peer_copy_port_.store(port); }
  uint16_t peer_copy_port() const { return peer_copy_port_.load(); }
  void SetNoPrestart(const std::string& why) {
    MutexLock lock(mu_);
    no_prestart_ = why;
  }
  std::string no_prestart() const {
    MutexLock lock(mu_);
    return no_prestart_;
  }

 private:
  std::atomic<int> restarts_{-1};           // -1: none reported yet
  std::atomic<uint16_t> agent_store_port_{0};
  std::atomic<uint16_t> peer_copy_port_{0};
  mutable Mutex mu_;
  std::string no_prestart_ EFDL_GUARDED_BY(mu_);
};

// What this node told in its ack key (the ack last sent, the last kAck, the lease they went
// under), the outcome of its workers it still has to tell (AckRecord::prev_outcome, sent with
// every ack until it starts its next round) and the count of failures it reports as restarts
// until the agent counts them itself. Driver thread only.
class AckBook {
 public:
  // A worker failure this node reported (the restarts count until ReportRestarts).
  void CountFailure() { ++failures_; }
  int Restarts(const AgentNotes& notes) const { return notes.restarts().value_or(failures_); }

  // What this node's workers did in `round` (kOutcome*), told from now on.
  void NoteOutcome(int64_t round, const char* outcome, const std::string& detail) {
    constexpr size_t kMaxDetail = 300;   // the ack stays small
    outcome_.prev_round = round;
    outcome_.prev_outcome = outcome;
    outcome_.prev_detail = detail.substr(0, kMaxDetail);
  }
  // The node started a round: the news of the rounds before it is told.
  void ClearOutcome() { outcome_ = AckRecord{}; }
  // `ack` carries the outcome still to tell (none: unchanged).
  void AddOutcome(AckRecord& ack) const {
    if (outcome_.prev_round == 0) return;
    ack.prev_round = outcome_.prev_round;
    ack.prev_outcome = outcome_.prev_outcome;
    ack.prev_detail = outcome_.prev_detail;
  }
  // `ack` was written under `lease`.
  void Sent(const AckRecord& ack, int64_t lease) {
    if (ack.state == AckState::kAck) last_ack_ = ack;
    last_sent_ = ack;
    last_sent_lease_ = lease;
  }
  // The kAck of `round` sent last, for a re-send with a late outcome; nullopt when the last
  // kAck was of another round.
  std::optional<AckRecord> LastAckOf(int64_t round) const {
    if (last_ack_.round != round) return std::nullopt;
    return last_ack_;
  }
  // The ack last sent under `lease`, with the agent's new count of restarts, to write again;
  // nullopt when there is none or it already says so (never re-sent under another lease).
  std::optional<AckRecord> WithRestarts(int64_t lease, int restarts) {
    if (lease == 0 || lease != last_sent_lease_ || last_sent_.round == 0 ||
        last_sent_.restarts == restarts) {
      return std::nullopt;
    }
    last_sent_.restarts = restarts;
    if (last_ack_.round == last_sent_.round) last_ack_.restarts = restarts;
    return last_sent_;
  }

 private:
  AckRecord outcome_;            // prev_*: the outcome to tell (prev_round 0: nothing)
  AckRecord last_ack_;           // the last kAck sent (re-sent with a late outcome)
  AckRecord last_sent_;          // the last ack of any state sent (round 0: none)
  int64_t last_sent_lease_ = 0;  // ... under this lease
  int failures_ = 0;             // failures reported (ReportWorkerFailure)
};

// Counting the job's registered nodes (a count-only range over nodes/) costs etcd O(N): etcd 3.4
// walks the whole nodes/ index for it. A node that counts N nodes counts again at most once per
// CountGap(N): at least `floor`, and long enough that N nodes counting as often send at most
// kJobRequestsPerSecond counts per second together, at any N (src/common/job_rate.h
// JobRatePeriod, which also bounds the straggler reads of src/health/straggler_rules.h
// PublishPeriod; issue #37).
inline std::chrono::milliseconds CountGap(int64_t nodes, std::chrono::milliseconds floor) {
  return std::max(floor, JobRatePeriod(nodes));
}

// The pace of one node's counts of the registered nodes, for Unplaced and JobEndCheck: when the
// next count is due, the gap after a count (CountGap of the count, at least `floor`), this node's
// own point within a first count's gap (so that nodes that began together do not count
// together), and, while the node does not count, a count that fell due moving on by whole gaps
// (so that it keeps its point and the nodes do not all count at once when they count again).
// Driver thread only.
class PacedCount {
 public:
  PacedCount(std::chrono::milliseconds floor, TimePoint due)
      : floor_(floor), gap_(floor), due_(due) {}
  // This node's point (`unit_random` in [0, 1)) in a job of `nodes` nodes, whose CountGap is the
  // gap until the first count.
  void Spread(int64_t nodes, double unit_random) {
    unit_ = unit_random;
    gap_ = CountGap(nodes, floor_);
  }
  bool spread() const { return unit_.has_value(); }
  // This node's point within JobRatePeriod(nodes) (zero before Spread).
  Clock::duration PointWithin(int64_t nodes) const {
    return std::chrono::duration_cast<Clock::duration>(JobRatePeriod(nodes) * unit_.value_or(0));
  }
  TimePoint due() const { return due_; }
  Clock::duration gap() const { return gap_; }
  void DueAt(TimePoint at) { due_ = at; }
  bool Due(TimePoint now) const { return now >= due_; }
  // A count made at `at` counted `nodes`: the next one waits CountGap(nodes).
  void Counted(TimePoint at, int64_t nodes) {
    gap_ = CountGap(nodes, floor_);
    due_ = at + gap_;
  }
  // Not counting now: a count that fell due moves on by whole gaps (none due: unchanged).
  void NotCounting(TimePoint now) {
    if (due_ != TimePoint::max() && due_ <= now) due_ += gap_ * ((now - due_) / gap_ + 1);
  }

 private:
  std::chrono::milliseconds floor_;
  Clock::duration gap_;                // CountGap of the last count, or of the spread's job
                                       // (`floor` before either)
  TimePoint due_;                      // TimePoint::max(): none due
  std::optional<double> unit_;         // this node's point (Spread)
};

// After a peer gave up: whether this node can still wait for the job to go on. It cannot when
// its own workers failed too, or its round broke with the peer's failure; then it counts the
// registered nodes while it has no place, to end when fewer than MIN remain
// (CheckEveryNodeFailed): every kCheckInterval, or CountGap(last count) in a large job; the
// first check after a peer gave up comes within CountGap(the job's size) at a random point of
// this node's (every node sees the same record at once). Driver thread only.
class JobEndCheck {
 public:
  static constexpr std::chrono::seconds kCheckInterval{1};
  void PeerGaveUp(std::string why) { peer_gave_up_ = std::move(why); }
  const std::optional<std::string>& peer_gave_up() const { return peer_gave_up_; }
  void WorkersFailed(const std::string& detail) { own_failure_ = detail; }
  // The round this node ran a place in closed not gracefully (a peer's failure broke it,
  // possibly before this node's workers failed: in-process they pause).
  void RoundBroke(std::string why) { round_broken_ = std::move(why); }
  void WorkersSucceeded() {
    own_failure_.reset();
    round_broken_.reset();
  }
  // Why this node cannot wait for the job to go on after a peer gave up (nullopt: it can).
  std::optional<std::string> OwnBreak() const {
    if (own_failure_) return fmt::format("this node's workers failed too ({})", *own_failure_);
    if (round_broken_) return fmt::format("this node's round broke with it ({})", *round_broken_);
    return std::nullopt;
  }
  // A peer gave up now in a job of about `job_nodes` nodes: check at this node's point within
  // CountGap(job_nodes) (`unit_random` in [0, 1) picks it, once per node), never later than a
  // check already due, never sooner than the gap after the last check.
  void CheckFrom(TimePoint now, int64_t job_nodes, double unit_random) {
    if (!pace_.spread()) pace_.Spread(job_nodes, unit_random);
    const TimePoint at = now + pace_.PointWithin(job_nodes);
    pace_.DueAt(std::max(std::min(pace_.due(), at), last_check_ + pace_.gap()));
  }
  // When the check is due (nullopt: nothing to check).
  std::optional<TimePoint> NextCheck() const {
    if (peer_gave_up_ && OwnBreak()) return pace_.due();
    return std::nullopt;
  }
  // Whether to check now; the next check then comes a gap later (Counted sets the gap).
  bool Due(TimePoint now) {
    if (!peer_gave_up_ || !OwnBreak() || !pace_.Due(now)) return false;
    last_check_ = now;
    pace_.DueAt(now + pace_.gap());
    return true;
  }
  // The check just made counted `nodes` registered nodes.
  void Counted(int64_t nodes) { pace_.Counted(last_check_, nodes); }
  // The node holds a place now (no check): a check that fell due meanwhile moves on by whole
  // gaps, so that the nodes do not all check at once when their round closes.
  void NotChecking(TimePoint now) { pace_.NotCounting(now); }

 private:
  std::optional<std::string> peer_gave_up_;   // "node X gave up: why", the newest
  std::optional<std::string> own_failure_;    // this node's last worker failure, until a success
  std::optional<std::string> round_broken_;   // until a success
  TimePoint last_check_ = TimePoint::min();
  PacedCount pace_{kCheckInterval, TimePoint::max()};   // the checks (none due until CheckFrom)
};

// While this node has no place in a round (registered, closed, not yet started): since when, for
// the join timeout, and a waiting notice every kNoticeInterval (issue #22) that says what the
// node waits for. The notice costs etcd nothing: it tells what the node holds. Only while the
// job gathers does the number of registered nodes say more, and counting them costs etcd O(N),
// so the node counts on its own clock: first kNoticeInterval into its wait (plus, in a job whose
// MAX is above kJobRequestsPerSecond x kNoticeInterval, its own random point within
// CountGap(MAX), so nodes that began to wait together do not count together), then once per
// CountGap(last count); the notices tell the last count. Driver thread only.
class Unplaced {
 public:
  static constexpr std::chrono::seconds kNoticeInterval{15};
  struct Count {
    TimePoint at;
    int64_t nodes = 0;
  };
  // Once, before the node registers: its place within the first count's spread in a job of up
  // to `max_nodes` nodes (`unit_random` in [0, 1)).
  void SpreadCounts(int64_t max_nodes, double unit_random) {
    pace_.Spread(max_nodes, unit_random);
    spread_ = pace_.gap() > kNoticeInterval ? pace_.PointWithin(max_nodes)
                                            : Clock::duration::zero();
  }
  void Since(TimePoint now) {
    since_ = now;
    last_count_.reset();
    count_error_.reset();
    pace_.DueAt(std::max(pace_.due(), now + kNoticeInterval + spread_));
  }
  void Placed() { since_.reset(); }
  const std::optional<TimePoint>& since() const { return since_; }
  // When the next waiting notice is due (only while unplaced).
  TimePoint NextNotice() const { return std::max(*since_, last_notice_) + kNoticeInterval; }
  bool NoticeDue(TimePoint now) {
    if (!since_ || now < NextNotice()) return false;
    last_notice_ = now;
    return true;
  }
  // When this node may count the registered nodes next (only while unplaced and gathering).
  TimePoint NextCount() const { return pace_.due(); }
  bool CountDue(TimePoint now) const { return since_ && pace_.Due(now); }
  // It counted `nodes` now: the next count waits CountGap(nodes).
  void Counted(TimePoint now, int64_t nodes) {
    last_count_ = Count{now, nodes};
    count_error_.reset();
    pace_.Counted(now, nodes);
  }
  // The job does not gather now: a count that fell due meanwhile moves on by whole gaps, so
  // that this node keeps its own point within the gap when the job gathers again (else every
  // node that waited through a proposal would count at once).
  void NotCounting(TimePoint now) { pace_.NotCounting(now); }
  // The count failed (etcd did not answer): the next one a notice later.
  void CountFailed(TimePoint now, std::string error) {
    count_error_ = std::move(error);
    pace_.DueAt(now + kNoticeInterval);
  }
  // The last count of this wait, and whether the last attempt failed.
  const std::optional<Count>& last_count() const { return last_count_; }
  const std::optional<std::string>& count_error() const { return count_error_; }

 private:
  std::optional<TimePoint> since_;
  TimePoint last_notice_{};
  Clock::duration spread_{};   // this node's point within the first count's gap (SpreadCounts)
  PacedCount pace_{kNoticeInterval, TimePoint{}};   // the counts
  std::optional<Count> last_count_;
  std::optional<std::string> count_error_;
};

// Whom this node follows (node_rules.h WhomToFollow), when it takes over from them once their
// key is gone, and the takeovers it saw within kTakeoverPeriod (node_rules.h TakeoverBackoff).
// Driver thread only.
class TakeoverClock {
 public:
  const Succession& Follow(Succession succession) {
    succession_ = std::move(succession);
    return succession_;
  }
  const Succession& succession() const { return succession_; }
  // The round record named a coordinator that took over.
  void SawTakeOver(TimePoint now) { seen_.push_back(now); }
  // The takeovers seen within kTakeoverPeriod before `now` (older ones are forgotten).
  size_t Recent(TimePoint now) {
    while (!seen_.empty() && now - seen_.front() > kTakeoverPeriod) seen_.pop_front();
    return seen_.size();
  }
  void Arm(TimePoint at) { at_ = at; }
  void Disarm() { at_.reset(); }
  const std::optional<TimePoint>& at() const { return at_; }
  // Whether the takeover is due now (it is then disarmed).
  bool Due(TimePoint now) {
    if (!at_ || now < *at_) return false;
    at_.reset();
    return true;
  }

 private:
  Succession succession_;
  std::optional<TimePoint> at_;      // the takeover, when the followed coordinator is gone
  std::deque<TimePoint> seen_;       // oldest first
};

// When this node registers again after a fence or a withdrawal, until when it may try (the join
// timeout from the fence, or from the end of the cool-down), and what its registrations took:
// the latency of the last one (node_rules.h JoinBackoff) and the lease expiries (node_rules.h
// TtlAfterExpiries). Driver thread only; `unit_random` in [0, 1) spreads the back-offs.
class RejoinClock {
 public:
  // While withdrawn, how often the node reads whether the job completed or was suspended
  // meanwhile (one small read per excluded node).
  static constexpr std::chrono::seconds kWithdrawnCheck{2};

  void NoteJoinLatency(std::chrono::milliseconds latency) { last_join_latency_ = latency; }
  std::chrono::milliseconds Backoff(int attempt, double unit_random) const {
    return JoinBackoff(attempt, last_join_latency_, unit_random);
  }
  void LeaseExpired() { ++lease_expiries_; }
  // The TTL to register with: `ttl`, longer after lease expiries.
  std::chrono::milliseconds Ttl(std::chrono::milliseconds ttl) const {
    return TtlAfterExpiries(ttl, lease_expiries_);
  }
  // Fenced now: register again at once while etcd is fast, spread when it is slow.
  void Fenced(TimePoint now, double unit_random) {
    fenced_since_ = now;
    attempt_ = 0;
    at_ = now + Backoff(0, unit_random);
  }
  // Withdrawn now for `cooldown`: register again once it is over; the join timeout of a
  // failing rejoin counts from there.
  void Withdrawn(TimePoint now, std::chrono::milliseconds cooldown) {
    withdrawn_until_ = now + cooldown;
    next_withdrawn_check_ = now;
    attempt_ = 0;
    at_ = *withdrawn_until_;
    fenced_since_ = *withdrawn_until_;
  }
  bool withdrawn() const { return withdrawn_until_.has_value(); }
  // While withdrawn: whether to read the job's round now (every kWithdrawnCheck, while the
  // rejoin is still ahead).
  bool WithdrawnCheckDue(TimePoint now) {
    if (now < next_withdrawn_check_) return false;
    next_withdrawn_check_ = now + kWithdrawnCheck;
    return at_ && *at_ > now;
  }
  void RejoinAt(TimePoint at) { at_ = at; }
  void Cancel() { at_.reset(); }
  std::optional<TimePoint> NextDeadline() const {
    std::optional<TimePoint> d = at_;
    if (withdrawn_until_ && (!d || next_withdrawn_check_ < *d)) d = next_withdrawn_check_;
    return d;
  }
  // Whether to register again now (the rejoin is then no longer pending).
  bool Due(TimePoint now) {
    if (!at_ || now < *at_) return false;
    at_.reset();
    return true;
  }
  // Registered again; true when that ended a withdrawal.
  bool Rejoined() {
    fenced_since_.reset();
    return std::exchange(withdrawn_until_, std::nullopt).has_value();
  }
  // A failed rejoin: whether the join timeout since the fence (or the cool-down's end) is over.
  bool OutOfTime(TimePoint now, std::chrono::milliseconds join_timeout) const {
    return fenced_since_ && now - *fenced_since_ >= join_timeout;
  }
  // A failed rejoin within the join timeout: the next attempt, backed off.
  void Retry(TimePoint now, double unit_random) {
    at_ = now + std::max<std::chrono::milliseconds>(std::chrono::seconds(1),
                                                    Backoff(++attempt_, unit_random));
  }

 private:
  std::optional<TimePoint> at_;                   // the next registration attempt
  std::optional<TimePoint> fenced_since_;         // the join timeout of the rejoin counts from
  int attempt_ = 0;                               // failed rejoins since the fence
  std::chrono::milliseconds last_join_latency_{0};   // how long the last registration took
  int lease_expiries_ = 0;                        // fences by lease expiry
  std::optional<TimePoint> withdrawn_until_;      // withdrawn for a cool-down until then
  TimePoint next_withdrawn_check_{};
};

}  // namespace efdl::rdzv::internal
