// NodeFailures (node_failures.h): the collateral streak and the exclusion's end.
#include "agent/node_failures.h"

namespace efdl::agent {

void NodeFailures::RoundFormed(int nnodes) {
  if (nnodes == streak_nnodes_) return;
  streak_ = 0;
  streak_nnodes_ = nnodes;
}

bool NodeFailures::CollateralCounts(Clock::time_point now, Clock::time_point round_started) {
  // A streak of collateral failures with no round that lasted between them may be this node's
  // doing after all (its peers finished, or it breaks what it connects to): from
  // kCollateralStreak on, they count, so the node cannot loop for ever.
  streak_ = now - round_started >= kStreakReset ? 1 : streak_ + 1;
  return streak_ > std::max(kCollateralStreak, 2 * own_.policy().max_restarts);
}

NodeFailures::Out NodeFailures::CheckOut(Clock::time_point now) {
  if (!out_until_) return Out::kNo;
  if (now < *out_until_) return Out::kStill;
  out_until_.reset();
  return Out::kBack;
}

}  // namespace efdl::agent
