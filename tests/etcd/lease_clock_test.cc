// LeaseClock: when a kept lease is renewed and when it is lost, on a fake clock.
#include "etcd/lease_clock.h"

#include <gtest/gtest.h>

namespace efdl::etcd {
namespace {

using namespace std::chrono_literals;
using TimePoint = LeaseClock::TimePoint;

const TimePoint kT0 = TimePoint{} + 1000s;

TEST(ExpiryGrace, IsAFifthOfTheTtlAtMostOneSecond) {
  EXPECT_EQ(ExpiryGrace(1), 200ms);
  EXPECT_EQ(ExpiryGrace(2), 400ms);
  EXPECT_EQ(ExpiryGrace(5), 1000ms);
  EXPECT_EQ(ExpiryGrace(10), 1000ms);
  EXPECT_EQ(ExpiryGrace(0), 200ms);  // treated as 1 s
}

// The first renewal of a lease granted at kT0 with a TTL of 5 s: sent at once, answered at once.
void RenewAtT0(LeaseClock& c) {
  ASSERT_TRUE(c.Advance(kT0, true).send_renewal);
  ASSERT_EQ(c.OnAnswer(kT0, 5), LeaseClock::Answer::kRenewed);
}

TEST(LeaseClock, RenewsAtOnceThenEveryThirdOfTheTtlAfterEachAnswer) {
  LeaseClock c(6, kT0 + 6s, kT0);
  auto t = c.Advance(kT0, true);
  EXPECT_TRUE(t.send_renewal);
  EXPECT_EQ(c.OnAnswer(kT0 + 10ms, 6), LeaseClock::Answer::kRenewed);
  EXPECT_EQ(c.expires_at(), kT0 + 6s);  // the send time + TTL, not the answer's time
  t = c.Advance(kT0 + 10ms, true);
  EXPECT_FALSE(t.send_renewal);
  EXPECT_EQ(t.wake, kT0 + 2s);
  t = c.Advance(kT0 + 2s, true);
  EXPECT_TRUE(t.send_renewal);
  EXPECT_EQ(c.OnAnswer(kT0 + 2s + 5ms, 6), LeaseClock::Answer::kRenewed);
  EXPECT_EQ(c.expires_at(), kT0 + 8s);
  // A second answer to the same renewal (it was sent twice) changes nothing.
  EXPECT_EQ(c.OnAnswer(kT0 + 2s + 6ms, 6), LeaseClock::Answer::kIgnored);
}

TEST(LeaseClock, ResendsEvery500MsWhileUnansweredAndCountsFromTheOldestSend) {
  LeaseClock c(6, kT0 + 6s, kT0);
  ASSERT_TRUE(c.Advance(kT0, true).send_renewal);
  EXPECT_FALSE(c.Advance(kT0 + 499ms, true).send_renewal);
  EXPECT_TRUE(c.Advance(kT0 + 500ms, true).send_renewal);
  EXPECT_EQ(c.OnAnswer(kT0 + 700ms, 6), LeaseClock::Answer::kRenewed);
  EXPECT_EQ(c.expires_at(), kT0 + 6s) << "the oldest unanswered send time counts";
}

TEST(LeaseClock, EtcdUnreachableThroughTheGraceLosesTheLeaseAtItsEndAndNotBefore) {
  LeaseClock c(5, kT0 + 5s, kT0);
  ASSERT_NO_FATAL_FAILURE(RenewAtT0(c));
  c.OnStreamDown(kT0 + 1s);
  auto t = c.Advance(kT0 + 1s, false);
  EXPECT_FALSE(t.lost);
  EXPECT_FALSE(t.send_renewal);
  EXPECT_EQ(t.wake, kT0 + 5s);
  EXPECT_FALSE(c.Advance(kT0 + 5s - 1ms, false).lost);
  t = c.Advance(kT0 + 5s, false);
  EXPECT_FALSE(t.lost);
  EXPECT_TRUE(t.grace_started);
  EXPECT_FALSE(t.send_renewal) << "no stream to send on";
  EXPECT_EQ(t.wake, kT0 + 6s);
  EXPECT_FALSE(c.Advance(kT0 + 6s - 1ms, false).lost);
  EXPECT_TRUE(c.Advance(kT0 + 6s, false).lost) << "a partitioned node is fenced at the grace's end";
}

TEST(LeaseClock, EtcdBackInsideTheGraceIsAskedAtOnceAndKeepsTheLease) {
  // etcd restarted and serving 300 ms after the local expiry (it extended the lease when it
  // came back): the renewal sent on the new stream is answered inside the grace.
  LeaseClock c(5, kT0 + 5s, kT0);
  ASSERT_NO_FATAL_FAILURE(RenewAtT0(c));
  c.OnStreamDown(kT0 + 1600ms);
  ASSERT_TRUE(c.Advance(kT0 + 5s, false).grace_started);
  EXPECT_TRUE(c.Advance(kT0 + 5300ms, true).send_renewal) << "at once on the new stream";
  EXPECT_EQ(c.OnAnswer(kT0 + 5350ms, 6), LeaseClock::Answer::kRenewedInGrace);
  EXPECT_EQ(c.expires_at(), kT0 + 5300ms + 6s);
  EXPECT_FALSE(c.Advance(kT0 + 6500ms, true).lost);
}

TEST(LeaseClock, StreamBackJustBeforeTheExpiryAndAnsweredWithinTheGraceKeepsTheLease) {
  // The etcd-restart case: the stream came back 100 ms before the local expiry; the renewal sent
  // on it is answered 600 ms after the expiry (etcd extended the lease when it restarted).
  LeaseClock c(5, kT0 + 5s, kT0);
  ASSERT_NO_FATAL_FAILURE(RenewAtT0(c));
  c.OnStreamDown(kT0 + 1s);
  EXPECT_FALSE(c.Advance(kT0 + 3s, false).lost);
  auto t = c.Advance(kT0 + 4900ms, true);  // stream up again
  EXPECT_TRUE(t.send_renewal) << "renew as soon as the stream is back";
  t = c.Advance(kT0 + 5s, true);
  EXPECT_FALSE(t.lost);
  EXPECT_TRUE(t.grace_started);
  EXPECT_TRUE(t.send_renewal) << "a fresh renewal at the expiry";
  EXPECT_EQ(t.wake, kT0 + 5s + 500ms) << "resend cadence inside the grace";
  EXPECT_FALSE(c.Advance(kT0 + 5500ms, true).grace_started) << "reported once";
  EXPECT_EQ(c.OnAnswer(kT0 + 5600ms, 5), LeaseClock::Answer::kRenewedInGrace);
  EXPECT_FALSE(c.in_grace());
  EXPECT_EQ(c.expires_at(), kT0 + 4900ms + 5s);
  EXPECT_FALSE(c.Advance(kT0 + 6500ms, true).lost);
}

TEST(LeaseClock, ReachableEtcdThatDoesNotAnswerWithinTheGraceLosesTheLeaseAtItsEnd) {
  LeaseClock c(5, kT0 + 5s, kT0);
  ASSERT_NO_FATAL_FAILURE(RenewAtT0(c));
  // Renewals from 1.666 s on are sent on a live stream and never answered (a frozen member).
  for (auto at = kT0 + 1666ms; at < kT0 + 5s; at += 100ms) EXPECT_FALSE(c.Advance(at, true).lost);
  auto t = c.Advance(kT0 + 5s, true);
  EXPECT_FALSE(t.lost);
  EXPECT_EQ(c.expires_at(), kT0 + 5s);
  EXPECT_FALSE(c.Advance(kT0 + 5999ms, true).lost);
  EXPECT_TRUE(c.Advance(kT0 + 6s, true).lost);
}

TEST(LeaseClock, StreamBreakingDuringTheGraceDoesNotShortenOrExtendIt) {
  LeaseClock c(5, kT0 + 5s, kT0);
  ASSERT_NO_FATAL_FAILURE(RenewAtT0(c));
  ASSERT_TRUE(c.Advance(kT0 + 5s, true).grace_started);
  c.OnStreamDown(kT0 + 5200ms);
  EXPECT_FALSE(c.Advance(kT0 + 5200ms, false).lost);
  EXPECT_FALSE(c.Advance(kT0 + 5999ms, false).grace_started);
  EXPECT_TRUE(c.Advance(kT0 + 6s, false).lost);
}

TEST(LeaseClock, AnswerWithoutTtlLosesTheLeaseInOrOutOfTheGrace) {
  LeaseClock early(5, kT0 + 5s, kT0);
  ASSERT_TRUE(early.Advance(kT0, true).send_renewal);
  EXPECT_EQ(early.OnAnswer(kT0 + 1ms, 0), LeaseClock::Answer::kLost);
  LeaseClock late(5, kT0 + 5s, kT0);
  ASSERT_TRUE(late.Advance(kT0 + 5s, true).grace_started);
  EXPECT_EQ(late.OnAnswer(kT0 + 5100ms, -1), LeaseClock::Answer::kLost);
}

}  // namespace
}  // namespace efdl::etcd
