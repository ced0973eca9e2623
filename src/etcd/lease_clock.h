// The timing of one kept lease, without I/O: when to send a renewal, and when the lease is lost.
// KeepAliveEngine (lease_keeper.h) keeps one per lease and does the sending; the decisions live
// here so that they can be tested with a fake clock.
//
// The local expiry is the send time of the oldest unanswered renewal plus the TTL etcd granted
// in its last answer, so it is never later than etcd's own expiry. At the local expiry etcd gets
// a short grace (ExpiryGrace: a fifth of the TTL, at most 1 s) to decide: a fresh renewal goes
// out (at once if a stream is up, else as soon as one is), and an answer with TTL > 0 keeps the
// lease; TTL <= 0, or no answer by the grace's end, loses it. etcd extends every lease when it
// restarts or elects a leader, so an etcd that serves again around the local expiry must not
// fence a node whose lease it still has; an etcd that stays unreachable (a partitioned node)
// still fences it, at most the grace after the local expiry.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>

namespace efdl::etcd {

// How long past a lease's local expiry an answer from a reachable etcd is awaited.
inline std::chrono::milliseconds ExpiryGrace(int64_t ttl_seconds) {
  return std::min(std::chrono::milliseconds(std::max<int64_t>(ttl_seconds, 1) * 1000 / 5),
                  std::chrono::milliseconds(1000));
}

class LeaseClock {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;

  // A lease granted for `ttl_seconds`, known to live until `expires_at`; renewed at once (it
  // may be old already).
  LeaseClock(int64_t ttl_seconds, TimePoint expires_at, TimePoint now)
      : ttl_seconds_(std::max<int64_t>(ttl_seconds, 1)), expires_at_(expires_at),
        next_renewal_(now) {}

  struct Tick {
    bool send_renewal = false;  // send one now (the stream is up)
    bool lost = false;          // tell the owner; the clock is done
    bool grace_started = false; // the local expiry passed unanswered (log it)
    TimePoint wake = TimePoint::max();  // when Advance must run next
  };

  // Called whenever the engine runs, and at least at `wake`.
  Tick Advance(TimePoint now, bool stream_up) {
    Tick t;
    if (now >= expires_at_) {
      if (grace_until_ && now >= *grace_until_) {
        t.lost = true;
        return t;
      }
      if (!grace_until_) {
        grace_until_ = expires_at_ + ExpiryGrace(ttl_seconds_);
        next_renewal_ = now;  // a fresh renewal, in case the one in flight was lost
        t.grace_started = true;
      }
    }
    if (stream_up && now >= next_renewal_) {
      t.send_renewal = true;
      if (!unanswered_since_) unanswered_since_ = now;
      next_renewal_ = now + ResendInterval();
    }
    t.wake = grace_until_ ? *grace_until_ : expires_at_;
    if (stream_up) t.wake = std::min(t.wake, next_renewal_);
    return t;
  }

  enum class Answer { kIgnored, kRenewed, kRenewedInGrace, kLost };
  // etcd answered a renewal with `ttl` (seconds; <= 0: etcd no longer has the lease).
  Answer OnAnswer(TimePoint now, int64_t ttl) {
    if (ttl <= 0) return Answer::kLost;
    if (!unanswered_since_) return Answer::kIgnored;  // a renewal already counted
    const TimePoint sent = *unanswered_since_;
    unanswered_since_.reset();
    ttl_seconds_ = ttl;
    expires_at_ = std::max(expires_at_, sent + std::chrono::seconds(ttl));
    next_renewal_ = std::max(now, sent + RenewInterval());
    const bool was_in_grace = grace_until_.has_value();
    grace_until_.reset();
    return was_in_grace ? Answer::kRenewedInGrace : Answer::kRenewed;
  }

  // The stream broke: renewals on it will never be answered; ask again on the next one. The
  // local expiry stays: only an answer extends it.
  void OnStreamDown(TimePoint now) {
    unanswered_since_.reset();
    next_renewal_ = now;
  }

  int64_t ttl_seconds() const { return ttl_seconds_; }
  TimePoint expires_at() const { return expires_at_; }
  bool in_grace() const { return grace_until_.has_value(); }

  // etcd's own cadence: a third of the TTL, so two renewals may fail before the lease expires.
  std::chrono::milliseconds RenewInterval() const {
    return std::chrono::milliseconds(ttl_seconds_ * 1000 / 3);
  }
  // While a renewal is unanswered, send another this often (a stream may have been re-opened,
  // or a request lost with a member that went away).
  std::chrono::milliseconds ResendInterval() const {
    return std::min(RenewInterval(), std::chrono::milliseconds(500));
  }

 private:
  int64_t ttl_seconds_;
  TimePoint expires_at_;
  TimePoint next_renewal_;
  std::optional<TimePoint> unanswered_since_;  // send time of the oldest unanswered renewal
  std::optional<TimePoint> grace_until_;
};

}  // namespace efdl::etcd
