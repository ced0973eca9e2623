#include "health/exclusion_rules.h"

#include <algorithm>

namespace efdl::health {

std::chrono::milliseconds CooldownFor(const ExclusionPolicy& policy, int exclusion) {
  int factor = 1;
  for (int i = 1; i < exclusion && factor < kMaxCooldownFactor; ++i) factor *= 2;
  return policy.cooldown * std::min(factor, kMaxCooldownFactor);
}

void OwnFailures::Expire(FailureClock::time_point now) {
  while (!recent_.empty() && now - recent_.front() >= policy_.window) recent_.pop_front();
}

int OwnFailures::InWindow(FailureClock::time_point now) const {
  return static_cast<int>(std::count_if(recent_.begin(), recent_.end(), [&](auto t) {
    return now - t < policy_.window;
  }));
}

FailureVerdict OwnFailures::Count(FailureClock::time_point now, bool can_exclude) {
  Expire(now);
  recent_.push_back(now);
  ++total_;
  FailureVerdict v;
  v.in_window = static_cast<int>(recent_.size());
  v.total = total_;
  if (policy_.enabled() && can_exclude) {
    if (v.in_window >= policy_.after) {
      v.action = FailureVerdict::Action::kExclude;
      v.exclusion = ++exclusions_;
      v.cooldown = CooldownFor(policy_, v.exclusion);
      v.until = now + v.cooldown;
      recent_.clear();   // back after the cool-down with a clean slate
    }
    return v;
  }
  if (total_ > policy_.max_restarts) v.action = FailureVerdict::Action::kGiveUp;
  return v;
}

}  // namespace efdl::health
