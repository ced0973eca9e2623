#include "rendezvous/node_rules.h"

#include <fmt/format.h>

#include <algorithm>

namespace efdl::rdzv {

bool ShouldAck(const RoundRecord& round, const NodePart& part) {
  return round.phase == Phase::kProposed && round.round > part.acked_round &&
         round.round > part.fenced_round;
}

bool AnnouncesLate(int64_t held_round, const RoundRecord& round, const NodePart& part) {
  if (held_round == 0 || held_round >= round.round || round.round <= part.fenced_round) {
    return false;
  }
  if (round.phase == Phase::kActive) return part.acked_round < round.round;
  if (round.phase == Phase::kGathering) return part.acked_round < round.round - 1;
  return false;
}

bool ClosesStartedRound(const RoundRecord& round, const NodePart& part) {
  return part.started_round != 0 &&
         (round.round != part.started_round || round.phase != Phase::kActive);
}

bool MayStart(const RoundRecord& round, const std::optional<AssignRecord>& assign,
              const NodePart& part) {
  return round.phase == Phase::kActive && assign && assign->round == round.round &&
         part.started_round != round.round && round.round > part.fenced_round;
}

Succession WhomToFollow(const RoundRecord& round, const NodePart& part) {
  Succession s;
  if (round.coordinator.empty() || round.coordinator == part.self ||
      round.phase == Phase::kComplete || round.phase == Phase::kSuspended) {
    return s;
  }
  auto it = std::find(round.deputies.begin(), round.deputies.end(), part.self);
  if (it != round.deputies.end()) {
    s.follow = round.coordinator;
    s.after_steps = static_cast<int>(it - round.deputies.begin());
    return s;
  }
  const bool runs_a_place = round.phase == Phase::kActive &&
                            part.started_round == round.round && !part.started_standby;
  if (runs_a_place) return s;
  s.follow = round.coordinator;
  s.after_steps = static_cast<int>(kMaxDeputies);
  s.spread = true;
  return s;
}

bool FollowWatchCovers(const FollowWatch& watch, const std::string& coordinator,
                       int64_t follow_after) {
  return !coordinator.empty() && watch.coordinator == coordinator && watch.from <= follow_after;
}

bool FollowedIsGone(const FollowWatch& watch, const std::string& followed, int64_t follow_after) {
  return !followed.empty() && watch.coordinator == followed && watch.deleted_at > follow_after;
}

RoundRecord FailureProposal(const RoundRecord& round, const std::string& self,
                            const std::string& detail, bool lost_peer) {
  RoundRecord next = round;
  next.round = round.round + 1;
  next.phase = Phase::kProposed;
  next.coordinator = self;
  next.graceful = false;
  next.message = lost_peer ? fmt::format("the workers of node {} lost a peer ({}); the cause "
                                         "is on another node", self, detail)
                           : fmt::format("workers of node {} failed: {}", self, detail);
  // Keep the deputies but never name ourselves (a coordinator is not its own deputy).
  std::erase(next.deputies, self);
  return next;
}

int64_t FencedRound(const RoundRecord& round, const NodePart& part) {
  const bool decided = round.phase == Phase::kActive || round.phase == Phase::kComplete;
  return std::max(part.started_round, decided ? round.round : 0);
}

std::chrono::milliseconds JoinBackoff(int attempt, std::chrono::milliseconds last_join_latency,
                                      double unit_random) {
  if (attempt <= 0 && last_join_latency < kSlowEtcd) return std::chrono::milliseconds(0);
  int64_t base = std::max(last_join_latency, kSlowEtcd).count();
  for (int i = 0; i < attempt && base < kMaxJoinBackoff.count(); ++i) base *= 2;
  base = std::min(base, static_cast<int64_t>(kMaxJoinBackoff.count()));
  const double r = std::clamp(unit_random, 0.0, 1.0);
  const int64_t half = base / 2;
  return std::chrono::milliseconds(half + static_cast<int64_t>(r * static_cast<double>(half)));
}

std::chrono::milliseconds TtlAfterExpiries(std::chrono::milliseconds ttl, int expiries) {
  auto out = ttl;
  for (int i = 0; i < std::min(expiries, 3); ++i) out *= 2;
  return std::max(ttl, std::min(out, kMaxAdaptedTtl));
}

std::chrono::milliseconds TakeoverBackoff(size_t recent_takeovers) {
  if (recent_takeovers < static_cast<size_t>(kMaxTakeoversPerPeriod)) {
    return std::chrono::milliseconds(0);
  }
  const size_t over = recent_takeovers - static_cast<size_t>(kMaxTakeoversPerPeriod) + 1;
  return kTakeoverPeriod / kMaxTakeoversPerPeriod * static_cast<int64_t>(over);
}

}  // namespace efdl::rdzv
