// The mark rule (snapshot/commit_marks.h): which commits the persisters and the peer-copy
// senders of every node take, from each node's own measurement of the commit period.
#include <gtest/gtest.h>

#include <cstdint>

#include "snapshot/commit_marks.h"

namespace efdl::snapshot {
namespace {

using namespace std::chrono_literals;

TEST(CommitMarksTest, StrideIsThePowerOfTwoThatCoversTheInterval) {
  EXPECT_EQ(MarkStride(200ms, 1000ms), 8u);    // 4 x 200 ms < 1 s <= 8 x 200 ms
  EXPECT_EQ(MarkStride(250ms, 1000ms), 4u);    // exactly: 4 x 250 ms = 1 s
  EXPECT_EQ(MarkStride(251ms, 1000ms), 4u);
  EXPECT_EQ(MarkStride(249ms, 1000ms), 8u);
  EXPECT_EQ(MarkStride(1ms, 1000ms), 1024u);
  EXPECT_EQ(MarkStride(100ms, 1000ms), 16u);
  // At most twice the interval: K x period < 2 x min_interval.
  for (int p = 1; p < 3000; p += 7) {
    const uint64_t k = MarkStride(std::chrono::milliseconds(p), 1000ms);
    EXPECT_GE(k * p, 1000u) << p;
    if (k > 1) {
      EXPECT_LT(k * p, 2000u) << p;
    }
  }
}

TEST(CommitMarksTest, EveryCommitWithoutAnIntervalOrWhenCommitsAreRarer) {
  EXPECT_EQ(MarkStride(1ms, 0ms), 1u);
  EXPECT_EQ(MarkStride(0ms, 0ms), 1u);
  EXPECT_EQ(MarkStride(1000ms, 1000ms), 1u);
  EXPECT_EQ(MarkStride(5s, 1000ms), 1u);
  for (uint64_t seq = 1; seq < 100; ++seq) EXPECT_TRUE(IsMark(seq, 1)) << seq;
  EXPECT_EQ(MarkStride(0ms, 1000ms), kMaxMarkStride);  // nothing measured yet: no mark
}

TEST(CommitMarksTest, MarksOfTwiceTheStrideAreMarksOfTheStride) {
  // Two nodes that measured slightly different periods pick K and 2K: every mark of 2K is one of
  // K, so the node with K stores (with 2 files kept) one that the node with 2K stores too.
  const uint64_t k1 = MarkStride(124ms, 1000ms);
  const uint64_t k2 = MarkStride(126ms, 1000ms);
  EXPECT_EQ(k1, 2 * k2);
  int shared = 0;
  for (uint64_t seq = 1; seq <= 64; ++seq) {
    if (IsMark(seq, k1)) {
      EXPECT_TRUE(IsMark(seq, k2)) << seq;
      ++shared;
    }
  }
  EXPECT_EQ(shared, 4);  // 16, 32, 48, 64
  // Of any two consecutive marks of K, one is a mark of 2K.
  for (uint64_t m = k2; m < 200; m += k2) EXPECT_TRUE(IsMark(m, k1) || IsMark(m + k2, k1)) << m;
  EXPECT_FALSE(IsMark(7, 8));
  EXPECT_TRUE(IsMark(0, 8));
}

TEST(CommitMarksTest, StrideFromTheObservedPeriod) {
  const auto t0 = MarkClock::time_point{} + 1000h;
  CommitMarks marks(1000ms);
  EXPECT_EQ(marks.Stride(t0), 1u);   // nothing observed
  // The first commit seen is taken at once; the next seq gives a period.
  marks.Observe(90, t0 - 1s);
  EXPECT_EQ(marks.Stride(t0 - 1s), 1u);
  marks.Observe(91, t0 - 1s + 100ms);
  EXPECT_EQ(marks.Stride(t0 - 1s + 100ms), 16u);
  // A commit every 200 ms, seen by a poll at each.
  for (int i = 0; i <= 30; ++i) marks.Observe(100 + i, t0 + i * 200ms);
  EXPECT_EQ(marks.Period(t0 + 6000ms), 200ms);
  EXPECT_EQ(marks.Stride(t0 + 6000ms), 8u);
  // Polls between commits see the same seq: the period does not change.
  marks.Observe(130, t0 + 6100ms);
  EXPECT_EQ(marks.Stride(t0 + 6100ms), 8u);
  // Commits speed up to every 50 ms: within the window K follows.
  uint64_t seq = 130;
  auto t = t0 + 6000ms;
  for (int i = 0; i < 100; ++i) marks.Observe(++seq, t += 50ms);
  EXPECT_EQ(marks.Stride(t), 32u);
  // A pause (no commit for the interval) makes the newest commit a mark: K = 1.
  EXPECT_EQ(marks.Stride(t + 400ms), 4u);
  EXPECT_EQ(marks.Stride(t + 1000ms), 1u);
  // Commits rarer than the interval: every commit.
  CommitMarks rare(1000ms);
  for (int i = 0; i < 5; ++i) rare.Observe(i + 1, t0 + i * 3s);
  EXPECT_EQ(rare.Stride(t0 + 12s), 1u);
  // No interval: every commit, from the first.
  CommitMarks none(0ms);
  EXPECT_EQ(none.Stride(t0), 1u);
  // Another arena with smaller seqs starts the measurement over.
  marks.Observe(3, t);
  EXPECT_EQ(marks.Stride(t), 1u);
  marks.Observe(4, t + 10ms);
  EXPECT_EQ(marks.Stride(t + 10ms), 128u);
}

TEST(CommitMarksTest, PollDelayWakesBeforeTheNextMark) {
  const auto t0 = MarkClock::time_point{} + 1000h;
  CommitMarks marks(1000ms);
  for (int i = 0; i <= 20; ++i) marks.Observe(100 + i, t0 + i * 100ms);   // K = 16, seq 120
  const auto now = t0 + 2000ms;
  EXPECT_EQ(marks.Stride(now), 16u);
  // The next mark, 128, is due at +800 ms: wake one period before it.
  EXPECT_EQ(marks.PollDelay(now, 10s), 700ms);
  EXPECT_EQ(marks.PollDelay(now, 150ms), 150ms);   // never longer than the poll interval
  // Within a period of it: half a period.
  for (int i = 21; i <= 27; ++i) marks.Observe(100 + i, t0 + i * 100ms);
  EXPECT_EQ(marks.PollDelay(t0 + 2700ms, 10s), 50ms);
}

}  // namespace
}  // namespace efdl::snapshot
