#include "agent/round_reports.h"

#include <algorithm>

namespace efdl::agent {

void RoundReports::Add(const WorkerReport& r) {
  using Kind = WorkerReport::Kind;
  switch (r.kind) {
    case Kind::kStopping:
      stopping_[r.round].push_back(r.local_rank);
      if (r.released) released_[r.round].push_back(r.local_rank);
      return;
    case Kind::kPaused:
      paused_[r.round].push_back(r.local_rank);
      return;
    case Kind::kReturned: {
      // Once per rank (the program's loop and efdl's exit both may say it); not from a rank that
      // said `stopping` in this round: it exits 0 because the agent asked it to.
      auto& ranks = returned_[r.round];
      const auto stopped = stopping_.find(r.round);
      const bool asked = stopped != stopping_.end() &&
                         std::ranges::find(stopped->second, r.local_rank) != stopped->second.end();
      if (!asked && ranks.size() < kMaxPerRound &&
          std::ranges::find(ranks, r.local_rank) == ranks.end()) {
        ranks.push_back(r.local_rank);
      }
      return;
    }
    case Kind::kFailed:
    case Kind::kRaised:
      if (failures_.size() < kMaxPerRound) {
        failures_.push_back({r.round, r.rank, r.local_rank,
                             r.message.empty() ? "no detail given" : r.message,
                             r.kind == Kind::kRaised});
      }
      return;
    case Kind::kPersisted:
      if (r.step >= 0 && (!newest_persisted_ || r.step > *newest_persisted_)) {
        newest_persisted_ = r.step;
      }
      return;
  }
}

void RoundReports::ForgetBefore(int64_t round) {
  for (ByRound* m : {&stopping_, &released_, &paused_, &returned_}) {
    m->erase(m->begin(), m->lower_bound(round));
  }
}

std::vector<InProcessFailure> RoundReports::TakeInProcessFailures() {
  std::vector<InProcessFailure> out;
  out.swap(failures_);
  return out;
}

std::vector<int> RoundReports::Of(const ByRound& m, int64_t round) {
  auto it = m.find(round);
  return it == m.end() ? std::vector<int>{} : it->second;
}

RoundReports& ControlChannel::books() {
  for (const WorkerReport& r : server_.TakeReports()) books_.Add(r);
  return books_;
}

}  // namespace efdl::agent
