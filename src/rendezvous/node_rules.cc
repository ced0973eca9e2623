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

RoundRecord FailureProposal(const RoundRecord& round, const std::string& self,
                            const std::string& detail) {
  RoundRecord next = round;
  next.round = round.round + 1;
  next.phase = Phase::kProposed;
  next.coordinator = self;
  next.graceful = false;
  next.message = fmt::format("workers of node {} failed: {}", self, detail);
  // Keep the deputies but never name ourselves (a coordinator is not its own deputy).
  std::erase(next.deputies, self);
  return next;
}

}  // namespace efdl::rdzv
