// Private to src/rendezvous: the books an EtcdRendezvous (etcd_rendezvous_impl.h) keeps, one
// room each, so that the node's class holds its collaborators instead of their fields (issue #31):
//   EventQueue   the events for the agent (the driver pushes, the agent's thread waits);
//   AgentNotes   what the agent's thread tells the node for its acks;
//   AckBook      what this node told in its ack key, and the outcome it still has to tell;
//   JobEndCheck  after a peer gave up: whether this node's own break ends the job here too.
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

#include "common/thread_annotations.h"
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
// NoteNoPrestart); read on the driver when it writes an ack.
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

// After a peer gave up: whether this node can still wait for the job to go on. It cannot when
// its own workers failed too, or its round broke with the peer's failure; then it checks (every
// second while it has no place) whether fewer than MIN nodes remain (CheckEveryNodeFailed).
// Driver thread only.
class JobEndCheck {
 public:
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
  void CheckFrom(TimePoint now) { next_check_ = now; }
  // When the check is due (nullopt: nothing to check).
  std::optional<TimePoint> NextCheck() const {
    if (peer_gave_up_ && OwnBreak()) return next_check_;
    return std::nullopt;
  }
  // Whether to check now; the next check then comes a second later.
  bool Due(TimePoint now) {
    if (!peer_gave_up_ || !OwnBreak() || now < next_check_) return false;
    next_check_ = now + std::chrono::seconds(1);
    return true;
  }

 private:
  std::optional<std::string> peer_gave_up_;   // "node X gave up: why", the newest
  std::optional<std::string> own_failure_;    // this node's last worker failure, until a success
  std::optional<std::string> round_broken_;   // until a success
  TimePoint next_check_{};
};

}  // namespace efdl::rdzv::internal
