// Which commits the background copies take: the rule every node applies, the same way and
// without talking to the others (docs/snapshots.md, "The agent persists" and "Peer copy").
//
// A commit is a *mark* when its seq is a multiple of K, the smallest power of two with
// K x (the commit period this node measured) >= min_interval (EFDL_PERSIST_MIN_INTERVAL_MS); K is
// 1 when min_interval is 0, when commits are rarer than it, when none came for min_interval, and
// for the first commit a poller sees.
// The persister stores the newest ready mark, the peer-copy sender sends it: so storage and the
// peer copy are written about once per min_interval (at most twice as far apart), and since the
// commit seqs are aligned across ranks (Agreement across ranks) and K is a power of two, a node
// that measured a slightly different period picks K/2 or 2K, whose marks include every mark of
// 2K or K: every node stores and copies commits that the others store too. A mark that a poll
// saw too late (overwritten) is skipped; the next one is taken.
//
// CommitMarks measures the period from the newest seqs a poller observes over time (seq delta
// over time delta in a window of a few intervals; the time since the newest seq appeared bounds
// it from below, so a pause or the job's last commit turns K to 1). Not thread-safe: one per
// polling thread. Pure functions of their arguments (time is passed in), so tests drive them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>

namespace efdl::snapshot {

using MarkClock = std::chrono::steady_clock;

// K's bound (2^30 commits): for a period of 0.
inline constexpr uint64_t kMaxMarkStride = uint64_t{1} << 30;

// The smallest power of two K with K * period >= min_interval; 1 for min_interval <= 0.
inline uint64_t MarkStride(std::chrono::nanoseconds period, std::chrono::nanoseconds min_interval) {
  if (min_interval.count() <= 0) return 1;
  uint64_t k = 1;
  while (k < kMaxMarkStride &&
         static_cast<long double>(period.count()) * static_cast<long double>(k) <
             static_cast<long double>(min_interval.count())) {
    k *= 2;
  }
  return k;
}

inline bool IsMark(uint64_t seq, uint64_t stride) { return stride <= 1 || seq % stride == 0; }

class CommitMarks {
 public:
  explicit CommitMarks(std::chrono::milliseconds min_interval) : min_interval_(min_interval) {}

  // The newest ready seq seen at `now`. A smaller seq than before (another arena) starts over.
  void Observe(uint64_t newest_seq, MarkClock::time_point now) {
    if (!seen_.empty() && newest_seq < seen_.back().seq) seen_.clear();
    if (seen_.empty() || newest_seq != seen_.back().seq) seen_.push_back({newest_seq, now});
    // Keep a window of a few intervals, and at least two observations.
    const auto span = std::max<MarkClock::duration>(4 * min_interval_, std::chrono::seconds(1));
    while (seen_.size() > 2 && seen_[1].at <= now - span) seen_.pop_front();
  }

  // The measured commit period at `now`: the window's average, but at least the time since the
  // newest seq appeared. Zero before anything was observed.
  MarkClock::duration Period(MarkClock::time_point now) const {
    if (seen_.empty()) return MarkClock::duration::zero();
    MarkClock::duration period = now - seen_.back().at;
    if (seen_.size() >= 2) {
      const uint64_t seqs = seen_.back().seq - seen_.front().seq;
      period = std::max(period, (seen_.back().at - seen_.front().at) / static_cast<int64_t>(seqs));
    }
    return period;
  }

  // K at `now`. 1 while a single seq was observed: the first commit a poller sees is taken at
  // once (storage and the peer copy hold something from the start), as is the newest after a
  // pause of min_interval.
  uint64_t Stride(MarkClock::time_point now) const {
    if (min_interval_.count() <= 0 || seen_.size() < 2) return 1;
    return MarkStride(Period(now), min_interval_);
  }

  // How long a poller may wait before it looks again: `poll` at most; while the next mark is
  // more than one period away, until one period before it is due; then about half a period
  // (at least 1 ms), so that a mark is seen while it is still among the ready slots.
  MarkClock::duration PollDelay(MarkClock::time_point now, MarkClock::duration poll) const {
    const uint64_t k = Stride(now);
    if (k <= 1 || seen_.size() < 2) return poll;
    const auto period = Period(now);
    const uint64_t newest = seen_.back().seq;
    const uint64_t next = (newest / k + 1) * k;
    const auto due = seen_.back().at + period * static_cast<int64_t>(next - newest);
    const auto wait = due - period - now;
    if (wait > MarkClock::duration::zero()) return std::min(poll, wait);
    return std::min<MarkClock::duration>(
        poll, std::max<MarkClock::duration>(period / 2, std::chrono::milliseconds(1)));
  }

 private:
  struct Seen {
    uint64_t seq;
    MarkClock::time_point at;  // when it was first observed
  };
  std::chrono::milliseconds min_interval_;
  std::deque<Seen> seen_;
};

}  // namespace efdl::snapshot
